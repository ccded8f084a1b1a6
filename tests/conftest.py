"""Shared pytest setup: GPU tests (marked `gpu` or under tests/gpu/) are skipped on machines without CUDA; `no_ranks`
fails a test whose launcher starts a rank (its refusals come before any rank starts)."""
import pytest


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords or "/gpu/" in str(item.fspath)]
    if not gpu_items:
        return
    import torch  # only when GPU tests were collected: registry tests stay torch-free

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def no_ranks(monkeypatch):
    """Any rank the launcher starts fails the test: a refusal must come before any rank starts."""
    from runtime import launch

    def started(*args, **kwargs):
        raise AssertionError("a rank started")

    monkeypatch.setattr(launch, "launch", started)

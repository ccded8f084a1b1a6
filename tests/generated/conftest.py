"""Runs the generated-build tests on one CPU thread: at tiny sizes a thread pool costs more than it saves, and on a shared 2-core host its spinning threads slow every other process.
`no_ranks` fails a test whose launcher starts a rank (its refusals come before any rank starts)."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_ranks(monkeypatch):
    """Any rank the launcher starts fails the test: a refusal must come before any rank starts."""
    from runtime import launch

    def started(*args, **kwargs):
        raise AssertionError("a rank started")

    monkeypatch.setattr(launch, "launch", started)

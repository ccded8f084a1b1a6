"""Shared pytest setup: GPU tests (marked `gpu` or under tests/gpu/) are skipped on machines without CUDA."""
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

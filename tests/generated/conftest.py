"""Runs the generated-build tests on one CPU thread: at tiny sizes a thread pool costs more than it saves, and on a shared 2-core host its spinning threads slow every other process."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


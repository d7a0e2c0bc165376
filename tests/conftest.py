"""Fixtures shared by several test modules."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Train on one thread: the suite shares 2 cores, where 2-thread kernels thrash."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Unit tests run tiny models: thread hand-offs would cost more than the math on a 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

import os

import pyro
import pytest
import torch


@pytest.fixture(autouse=True)
def pyro_state():
    """Every test starts from an empty param store, a fixed seed and validation on."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    pyro.enable_validation(True)
    threads = torch.get_num_threads()
    # Two xdist workers share the CI machine's two cores: one thread each avoids oversubscription.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    pyro.clear_param_store()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where CUDA is available."""
    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(needs_cuda)

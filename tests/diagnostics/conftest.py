import matplotlib
import pytest


@pytest.fixture(autouse=True, scope="session")
def agg_backend():
    """Files only: no test may open a window (CI has no display)."""
    matplotlib.use("Agg")
    yield

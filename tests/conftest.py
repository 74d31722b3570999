"""Session fixtures shared by tests/ and tests/dist/."""

import pytest

from tests import torchvision_shim

torchvision_shim.install()  # first: torchvision's transforms importable beside the dev venv's CPU torch


@pytest.fixture(scope="session")
def demo_packed(tmp_path_factory):
    """A small packed demo dataset (200 samples, 512-token packs, ~18 packs), built once per session."""
    from tests.train_factory import make_demo_packed

    return make_demo_packed(tmp_path_factory.mktemp("demo_packed"))


@pytest.fixture(scope="session")
def omni_packed(tmp_path_factory):
    """The demo data with its listening tasks (``data demo --audio``), packed for ``demo_omni`` (an
    audio tower added to the demo model): rows mix text, images, videos and audio clips."""
    from tests.train_factory import make_demo_packed

    return make_demo_packed(tmp_path_factory.mktemp("omni_packed"), samples=120, recipe="demo_omni")


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One intra-op thread for a module's in-process training runs: under ``pytest -n 2`` on a small
    machine, two workers each spinning several OpenMP threads slow these runs down ~10x. Use with
    ``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

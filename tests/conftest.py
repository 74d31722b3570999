"""Session fixtures shared by tests/ and tests/dist/."""

import pytest


@pytest.fixture(scope="session")
def demo_packed(tmp_path_factory):
    """A small packed demo dataset (200 samples, 512-token packs, ~18 packs), built once per session."""
    from tests.train_factory import make_demo_packed

    return make_demo_packed(tmp_path_factory.mktemp("demo_packed"))

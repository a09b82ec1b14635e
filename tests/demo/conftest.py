import pytest


@pytest.fixture(scope="session")
def world_cache(tmp_path_factory):
    """One cache for the demo world, shared by the tests that run the demo's CLIs (each would build it)."""
    return tmp_path_factory.mktemp("world-cache")

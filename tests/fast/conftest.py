import pytest


@pytest.fixture(scope="session")
def no_vnni(tmp_path_factory):
    """What the kernel test files' ``products`` give with the no-VNNI copies, one child for all."""
    from tests.fast.no_vnni import run_without_vnni

    return run_without_vnni(tmp_path_factory.mktemp("no_vnni"))

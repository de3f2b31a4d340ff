import pytest

from megatron.training.builtin_data import ensure_builtin_dataset
from megatron.training.known_warnings import KNOWN, SOURCE


def pytest_configure(config):
    # pytest resets the warning filters around each phase to its own list: the known ones go there.
    for known in KNOWN:
        config.addinivalue_line("filterwarnings", f"ignore:{known.message}:"
                                                  f"{known.category.__name__}:{SOURCE}")


@pytest.fixture(autouse=True)
def _no_tool_outlives_its_test():
    """A failure-injection tool that a test started beside its job and left running (the test
    failed before joining it) is killed by PID when the test ends."""
    from tests.launch import BESIDE
    yield
    while BESIDE:
        proc = BESIDE.pop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> str:
    """A real-text dataset prefix (part of the stdlib sources), built once per test session."""
    return ensure_builtin_dataset(tmp_path_factory.mktemp("data"), max_bytes=400_000,
                                  progress=False, quiet=True)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """A 3-member etcd cluster on loopback, shared by a module's tests (each uses a namespace
    of its own); killed at the module's end."""
    from tests.etcd_cluster import EtcdCluster
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"))
    yield cluster
    cluster.stop()

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

# Tests are small; one thread keeps them fast and deterministic on 2-core machines.
torch.set_num_threads(int(os.environ.get("SWARM_TEST_THREADS", "1")))

TESTS = Path(__file__).parent
# Test workers take files in collection order (dev.sh passes --no-loadscope-reorder): the
# swarms of processes first, longest first, unit tests last. xdist's own order (files with
# the most tests first) left a worker alone for the last minute, running a swarm the
# other had no share of.
LONGEST_FIRST = ("multihost/test_public_run.py", "swarm/test_local_swarm.py", "swarm/test_join_leave.py",
                 "swarm/test_resume.py", "multihost/test_nat.py")
FOLDERS_FIRST = ("multihost", "swarm", "sim", "inproc")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():  # the GPU tier (tests/gpu) skips, it does not fail
        no_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(no_gpu)

    def rank(item: pytest.Item) -> tuple[int, int]:
        where = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        folder = where.split("/", 1)[0]
        return (LONGEST_FIRST.index(where) if where in LONGEST_FIRST else len(LONGEST_FIRST),
                FOLDERS_FIRST.index(folder) if folder in FOLDERS_FIRST else len(FOLDERS_FIRST))

    items.sort(key=rank)  # stable: a file's tests keep their order


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="session")
def chromium() -> str:
    """Headless Chromium for the dashboard test: Debian's package, installed here where
    missing (as root, from the Debian mirror)."""
    path = chromium_binary()
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"], env=env,
                       capture_output=True, timeout=900)
        path = chromium_binary()
    if path is None:
        message = ("chromium is missing and could not be installed "
                   "(needs root and apt-get: apt-get install chromium)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path

import os
import shutil
import subprocess

import pytest
import torch

# Tests are small; one thread keeps them fast and deterministic on 2-core machines.
torch.set_num_threads(int(os.environ.get("SWARM_TEST_THREADS", "1")))


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
        message = "chromium is missing and could not be installed (needs root and apt-get: apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path

import os

import pytest
import torch

# Tests are small; one thread keeps them fast and deterministic on 2-core machines.
torch.set_num_threads(int(os.environ.get("SWARM_TEST_THREADS", "1")))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)

"""What a node process imports, which is CPU and memory every volunteer's node and every
test's node pays at start-up: scipy.optimize (hivemind's averager needs it; we do not)
waits for its first use, and training steps never load torch._dynamo and sympy (any
call into torch.optim does, and so does backward(gradient): swarm_node/optim/inner.py,
StageWorker.backward)."""

import subprocess
import sys

PROBE = """
import sys
import swarm_node.net.dht, swarm_node.node  # torch's imports probe every module's __file__
print(type(sys.modules["scipy.optimize"]).__name__, len([m for m in sys.modules if m.startswith("scipy.")]))
import hivemind.averaging.load_balancing as balancing
print(balancing.load_balance_peers(100, [1.0, 3.0]))  # solves a linear program with scipy
print(type(sys.modules["scipy.optimize"]).__name__)
"""


def test_scipy_optimize_waits_for_its_first_use():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         check=True)
    deferred, balance, after = out.stdout.split("\n")[:3]
    assert deferred.split()[0] == "_ImportedOnFirstUse" and int(deferred.split()[1]) < 20
    assert sum(int(share) for share in balance.strip("()").split(",")) == 100
    assert after == "module"


TRAINING_PROBE = """
import sys
import torch
from swarm_node.data.spec import DataSpec
from swarm_node.optim import default_method
from swarm_node.spec import RunSpec
from swarm_node.train.rounds import step_if_ready
from swarm_node.train.worker import StageWorker
spec = RunSpec(run_id="imports", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
               samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=2))
first, last = StageWorker(spec, 0, 16), StageWorker(spec, 1, 16)
for _ in range(2):
    tokens, targets = torch.randint(0, 16, (4, 16)), torch.randint(0, 16, (4, 16))
    hidden = first.forward(tokens)
    _, grad = last.forward_backward_last(hidden, targets)
    first.backward(tokens, grad)
    step_if_ready(first), step_if_ready(last)
print(first.inner_step, last.inner_step, "torch._dynamo" in sys.modules, "sympy" in sys.modules)
"""


def test_inner_steps_load_neither_torch_dynamo_nor_sympy():
    out = subprocess.run([sys.executable, "-c", TRAINING_PROBE], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split() == ["2", "2", "False", "False"]

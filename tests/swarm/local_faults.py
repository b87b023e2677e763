"""``swarm-node local`` with faults injected through its seams, for test_local_faults.py:

    python local_faults.py oom STAGE -- LOCAL_ARGS...   the nodes of STAGE run out of memory
                                                         at their second inner step (exit 2)
    python local_faults.py stuck-eval -- LOCAL_ARGS...  the final evaluation's first path never
                                                         ends (as a big model's batch on a CPU)

In ``oom`` mode every node runs this file too (``swarm_node.local.swarm.NODE_PROGRAM``), as
``local_faults.py node oom STAGE join ...``: a real ``swarm-node join`` whose worker
raises torch's out-of-memory error, which the node turns into its one-line message."""

import sys
import threading
from pathlib import Path

import torch


def node(stage: int, argv: list[str]) -> int:
    from swarm_node.cli.main import main
    from swarm_node.train.worker import StageWorker

    ours = argv[argv.index("--stage") + 1] == str(stage)
    step = StageWorker.step

    def step_or_fail(self):
        if ours and self.inner_step >= 1:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB (injected by the test)"
            )
        return step(self)

    StageWorker.step = step_or_fail
    return main(argv)


def stuck(*args, **kwargs):
    import logging

    logging.getLogger("swarm_node.local").info("evaluation stuck (test seam)")
    threading.Event().wait()


def main(argv: list[str]) -> int:
    from swarm_node.cli.main import main as cli
    from swarm_node.local import evaluation as local_eval
    from swarm_node.local import swarm as local

    if argv[0] == "node":
        return node(int(argv[2]), argv[3:])
    split = argv.index("--")
    mode, local_args = argv[:split], argv[split + 1:]
    if mode[0] == "oom":
        local.NODE_PROGRAM = (str(Path(__file__).resolve()), "node", "oom", mode[1])
    elif mode[0] == "stuck-eval":
        local_eval.path_val_loss = stuck
    return cli(["local", *local_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

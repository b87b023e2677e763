"""What one ``swarm-node local`` run is asked for besides the run spec (``LocalConfig``):
its own file so the parts of local/ that read it (summary.py) need not import the swarm."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from swarm_node.local.chaos import ChaosPlan
from swarm_node.node_config import check_compute_share


@dataclass(frozen=True)
class LocalConfig:
    replicas: int = 2
    steps: int = 200
    device: str = "cpu"  # as --device names it; the final evaluation runs there too
    compile_stage: bool = False  # every node runs its stage through torch.compile (join --compile)
    threads_per_node: int = 1
    compute_share: float = 1.0  # each node computes at most this share of the time (--compute-share)
    round_timeout_s: float = 15.0
    blocking_rounds: bool = False
    lanes: bool = True  # False: the nodes' bulk transfers go over libp2p too (join --no-lanes)
    eval_batches: int = 8
    eval_batch_size: int = 64
    run_dir: Path | None = None  # keep node logs, weights and summaries here (default: a temp dir, removed)
    progress: bool = True
    stop_grace_s: float = 30.0  # for the nodes to write their summaries and weights at the end
    interrupt_grace_s: float = 5.0  # Ctrl-C / SIGTERM: then every process left is killed
    dashboard_port: int | None = None  # run a real swarm-bootstrap with its dashboard here (0: any port)
    chaos: ChaosPlan | None = None
    checkpoint_dir: Path | None = None  # every node writes checkpoints to its own sub-directory of this
    eval_threads: int | None = None  # torch threads of the final evaluation (default: the cores free then)

    def __post_init__(self) -> None:
        check_compute_share(self.compute_share)

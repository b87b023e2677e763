"""What every component of a node shares, handed in as one: the compute thread all
device work runs on, the wire thread the data path encodes and decodes on, the
transport its calls go through, the guard that decides about peers that fail or
misbehave, and the counters of what the node has done."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from swarm_node.net.guard import PeerGuard
from swarm_node.net.transport import Requester
from swarm_node.obs.stats import NodeStats

# train/compute.py's ComputeThread, or inline where no thread is wanted
Compute = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class NodeServices:
    compute: Compute
    transport: Requester
    guard: PeerGuard
    stats: NodeStats
    wire: Compute | None = None  # train/compute.py's WireThread; None: the compute thread does it

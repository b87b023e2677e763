"""Peer-local settings of a node: not shared, not hashed."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from swarm_node.wire.records import MAX_RECORD_TTL_S

DEFAULT_STARTUP_TIMEOUT_S = 60.0  # for the DHT to start and reach an initial peer (a busy one is retried)


def check_compute_share(share: float) -> None:
    """A compute share is a fraction of the time: above 0 (nan fails too), at most 1."""
    if not 0 < share <= 1:
        raise ValueError(f"the compute share must be above 0 and at most 1, got {share}")


_BASE58 = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")


@dataclass(frozen=True)
class NodeConfig:
    initial_peers: tuple[str, ...] = ()
    run_id: str | None = None  # which run to join when the initial peers publish several
    spec_find_timeout_s: float = 20.0  # how long to wait for an initial peer's run spec
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)  # every interface: others must reach us
    announce_maddrs: tuple[str, ...] = ()
    # direct lanes for bulk transfers (net/lanes.py) listen here (0: any free port); None: no lanes
    lane_port: int | None = 0
    identity_path: str | None = None
    client_mode: bool = False
    stage: int | None = None  # None: choose automatically
    device: str = "cpu"
    # --compile: the stage runs through torch.compile, compiled at start-up (train/compiled.py);
    # the same math, so peers of a run may differ in it
    compile_stage: bool = False
    threads: int | None = None  # torch threads of the compute thread (None: torch's default)
    # compute at most this share of the time (train/compute.py), for a shared machine
    compute_share: float = 1.0
    data_shard: tuple[int, int] | None = None  # (shard id, shard count); default: from the peer id
    # A prepared dataset (data kind manifest) is fetched into data_cache_dir/<manifest
    # hash>, kept within data_cache_gb (None: unbounded) by evicting shards trained.
    data_cache_dir: Path = field(default_factory=lambda: default_data_cache_dir())
    data_cache_gb: float | None = None
    data_private_mirrors: bool = False  # the dataset's mirrors may be at loopback or private addresses
    max_steps: int | None = None  # stop after this many inner steps (stage 0 drives the run)
    run_dir: Path | None = None  # where the summary and final weights are written
    # Outer rounds that stop the inner steps until the outer step is done (the paper's
    # form), instead of running beside them (ALGORITHM.md section 3.1): for comparison.
    blocking_rounds: bool = False
    # The caller of an exchange fetches the partner's payload after sending its own, not
    # at the same time (the order of outer protocol 2.0): for comparison.
    one_payload_at_a_time: bool = False
    # stage 0: at most this many micro-batches in the pipeline at once; how many it keeps
    # is measured (routing/window.py): 2-3 on a CPU, more where compute is fast next to a hop
    max_in_flight: int = 8
    max_queue: int = 32  # micro-batches a node accepts at once before answering busy
    hop_timeout_s: float = 30.0  # deadline of one micro-batch through the rest of the pipeline
    # A slow link stretches that deadline (routing/window.py), to at most this; the most a
    # caller may ask of us for one micro-batch, too.
    max_hop_deadline_s: float = 300.0
    hop_retries: int = 3
    round_timeout_s: float = 20.0  # how long to seek a partner before the local-only step
    # floor of an outer exchange's deadline; larger stages get more, see below
    exchange_timeout_s: float = 30.0
    # The slowest upload a peer of the run is expected to have. An exchange's deadline
    # stretches to three times one payload's time at this rate (the two move at once:
    # the slack is for a shared or slower link; 50M parameters in near4-3 at 20 Mbit/s:
    # 18 s each way, 55 s).
    slowest_link_mbit_s: float = 20.0
    # An exchange's deadline also stretches with our own uplink as the pipeline measured it
    # (gossip/exchange_times.py ExchangeTimes.deadline_s), to at most this.
    max_exchange_s: float = 300.0
    heartbeat_s: float = 2.0
    record_ttl_s: float = 15.0
    registry_poll_s: float = 1.0
    # A joiner gives a state donor up when no chunk came for state_stall_s, or when it fell
    # more than state_stall_s behind state_min_mbit_s; a download is cut at the stage's
    # state at that rate (state/sync.py). No fixed total: 2.6 GB at 20 Mbit/s takes 18 min.
    state_stall_s: float = 60.0
    state_min_mbit_s: float = 1.0
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    # Nodes started together (a local swarm): stage 0, which drives the pipeline, waits
    # before its first micro-batch (at most startup_timeout_s) until its stage (itself
    # counted) and the next show this many training peers, so that no node trains
    # through its rounds before its partners are up. 0: start at once, as a volunteer
    # joining a live run does.
    wait_for_peers_per_stage: int = 0
    connectivity_check_s: float = 5.0  # period of the "am I still connected to anyone" check
    download_state: bool = True
    # A peer to ask first for the stage's state (a host's own node next to us, say); its
    # state is checked against the stage's other replicas like any donor's.
    state_from: str | None = None
    checkpoint_dir: Path | None = None  # resume from here at start; save after rounds and on shutdown
    checkpoint_every_rounds: int = 1
    # A checkpoint more than this many rounds behind its stage is only a starting point:
    # the node downloads a live peer's state on top (a merge that far apart would be
    # rejected by the partner's screens, or pull the stage back).
    catch_up_rounds: int = 2
    # A partner's Delta norm above this multiple of our own recent Delta norms, at our
    # round, is rejected (round local-only, partner off for 30 minutes; gossip/
    # partner_check.py); activations and gradients are held to the recent median of
    # what we saw, looser.
    max_update_ratio: float = 3.0
    max_peer_faults: int = 8  # malformed requests from one caller before it is banned
    caller_ban_s: float = 600.0
    max_activation_ratio: float = 100.0
    metrics_sinks: tuple[str, ...] = ("jsonl",)  # jsonl, tensorboard, wandb (offline); () for none
    metrics_dir: Path | None = None  # default: run_dir, else ./runs/<run id>
    http_host: str = "127.0.0.1"
    http_port: int | None = None  # serve /healthz, /metrics, /api/status here (0: any free port)
    progress: bool = True
    command_line: tuple[str, ...] = ()  # how the node was started: the resume hint repeats it

    def exchange_link_s(self, payload_bytes: int) -> float:
        """What the slowest link allows one outer exchange whose payload is ``payload_bytes``
        each way: both payloads' time, one after the other, and half again (three times
        the time they take at once)."""
        return 1.5 * 2 * payload_bytes * 8 / (self.slowest_link_mbit_s * 1e6)

    def exchange_timeout_for(self, payload_bytes: int) -> float:
        """The deadline of one outer exchange: the link's time, at least the floor."""
        return max(self.exchange_timeout_s, self.exchange_link_s(payload_bytes))

    def __post_init__(self) -> None:
        check_compute_share(self.compute_share)
        if self.data_cache_gb is not None and not self.data_cache_gb > 0:
            raise ValueError(f"--data-cache-gb must be positive, got {self.data_cache_gb}")
        if self.slowest_link_mbit_s <= 0:
            raise ValueError("slowest_link_mbit_s must be positive")
        if not (self.state_stall_s > 0 and self.state_min_mbit_s > 0):
            raise ValueError("state_stall_s and state_min_mbit_s must be positive")
        if self.max_exchange_s < self.exchange_timeout_s:
            raise ValueError("max_exchange_s must be at least exchange_timeout_s")
        if self.max_hop_deadline_s < self.hop_timeout_s:
            raise ValueError("max_hop_deadline_s must be at least hop_timeout_s")
        if self.checkpoint_every_rounds < 1:
            raise ValueError("checkpoint_every_rounds must be >= 1")
        if self.record_ttl_s > MAX_RECORD_TTL_S:
            raise ValueError(
                f"record_ttl_s must be at most {MAX_RECORD_TTL_S:.0f}: peers refuse longer-lived records"
            )
        if self.heartbeat_s * 3 > self.record_ttl_s:
            raise ValueError("heartbeat_s must be well inside record_ttl_s (at most a third)")
        if self.state_from is not None and not _BASE58.fullmatch(self.state_from):
            raise ValueError(f"--state-from takes a peer id (base58, as logs and the dashboard show it), "
                             f"got {self.state_from!r}")


def default_data_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swarm-node" / "data"

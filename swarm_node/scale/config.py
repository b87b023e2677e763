"""What a swarm-scale run models: the population, its links and compute, churn, and the
DHT's timing. Units are in the names; every field is checked before anything starts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScaleConfig:
    peers_per_stage: int = 16
    stages: int = 2
    method: str = "noloco"  # noloco: pairs; diloco: the whole stage each round (the barrier baseline)
    inner_steps: int = 50  # H
    duration_s: float = 600.0  # virtual time simulated
    seed: int = 0
    # Compute: a peer's median inner step is step_s times its own speed factor (log-normal,
    # sigma speed_sigma); each step varies around it by step_jitter_sigma; a share of
    # peers are stragglers, straggler_factor times slower.
    step_s: float = 1.0
    speed_sigma: float = 0.3
    step_jitter_sigma: float = 0.1
    straggler_share: float = 0.05
    straggler_factor: float = 3.0
    # Links: each peer's access round trip and uplink drawn log-uniformly from these
    # ranges (a pair's round trip is the mean of its two access round trips); downlinks
    # are downlink_factor times the uplink. A share of peers sit behind a NAT nobody can
    # dial (they take stage 0 and only call out, as real nodes do).
    rtt_ms: tuple[float, float] = (10.0, 200.0)
    uplink_mbit_s: tuple[float, float] = (5.0, 500.0)
    downlink_factor: float = 4.0
    unreachable_share: float = 0.0
    # Churn, per peer and hour: crashes (gone at once, record left to expire), graceful
    # leaves (a "leaving" record first); joins per stage and hour default to replacing
    # what leaves, so the population stays about the same.
    crash_per_hour: float = 0.0
    leave_per_hour: float = 0.0
    joins_per_stage_hour: float | None = None
    # The DHT: a record stored becomes visible to readers after a delay drawn from this
    # range (Kademlia lookups and replication), and expires at its TTL.
    record_delay_s: tuple[float, float] = (0.2, 2.0)
    # A get or store takes its lookup's round trips on the caller's link, or, where set,
    # these mean seconds (times 0.5-1.5): what a real run measured its DHT ops to take
    # (on a machine whose cores every node shares, far longer than the round trips).
    dht_get_s: float | None = None
    dht_store_s: float | None = None
    # What an outer payload weighs (one stage's phi and Delta as the run's codec sends
    # them; 4 MB: a 17M-parameter stage in near4-3): it sets how long an exchange takes.
    payload_bytes: int = 4_000_000
    activation_bytes: int = 1_000_000  # one micro-batch forward
    registry_shards: int = 1  # the run spec's: keys a stage's records are spread over
    # Compute seconds of an outer round's parts, which the model-free stage does in no time:
    # the snapshot and encoding at the boundary, decoding and checking the partner's
    # payload, and the outer step (what a real run measured, to compare with it).
    round_prepare_s: float = 0.0
    round_check_s: float = 0.0
    round_close_s: float = 0.0

    def __post_init__(self) -> None:
        if self.peers_per_stage < 2 or self.stages < 1:
            raise ValueError("a scale run needs at least 2 peers a stage and 1 stage")
        if self.method not in ("noloco", "diloco"):
            raise ValueError(f"method must be noloco or diloco, not {self.method!r}")
        if self.inner_steps < 2 or self.duration_s <= 0 or self.step_s <= 0:
            raise ValueError("inner_steps must be >= 2, duration_s and step_s positive")
        for name in ("rtt_ms", "uplink_mbit_s", "record_delay_s"):
            low, high = getattr(self, name)
            if not 0 <= low <= high or high <= 0:
                raise ValueError(f"{name} must be a range (low, high) with 0 <= low <= high, high > 0")
        for name in ("unreachable_share", "straggler_share"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1)")
        if self.unreachable_share * self.stages >= 1.0:
            raise ValueError(
                "unreachable peers all take stage 0: unreachable_share * stages must stay below 1"
            )
        if min(self.round_prepare_s, self.round_check_s, self.round_close_s) < 0:
            raise ValueError("round_prepare_s, round_check_s and round_close_s cannot be negative")
        if min(self.dht_get_s or 0.0, self.dht_store_s or 0.0) < 0:
            raise ValueError("dht_get_s and dht_store_s cannot be negative")
        if min(self.crash_per_hour, self.leave_per_hour, self.joins_per_stage_hour or 0.0) < 0:
            raise ValueError("churn rates cannot be negative")

    @property
    def total_peers(self) -> int:
        return self.peers_per_stage * self.stages

    @property
    def joins_per_stage_hour_effective(self) -> float:
        if self.joins_per_stage_hour is not None:
            return self.joins_per_stage_hour
        return (self.crash_per_hour + self.leave_per_hour) * self.peers_per_stage

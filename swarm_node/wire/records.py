"""The per-stage registry record each node heartbeats into the DHT
(key ``<run>/stage/<k>``, subkey = peer id). Small values only; parsed defensively
because anyone can write one."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from swarm_node.errors import ProtocolError

STATES = ("joining", "training", "finished", "leaving")
MAX_FIELD_CHARS = 64
MAX_ERROR_CHARS = 160
MAX_RECORD_TTL_S = 120.0  # nodes publish records for at most this long (NodeConfig refuses more)
CLOCK_SKEW_S = 60.0  # DHT expiries are wall-clock; hivemind already needs clocks about this close
REQUIRED_FIELDS = ("stage", "spec_hash", "version")  # every record carries these


@dataclass(frozen=True)
class PeerRecord:
    stage: int
    spec_hash: str
    version: str
    state: str = "training"
    throughput: float = 0.0  # samples/s EMA of this node's stage compute
    queue: int = 0  # micro-batches waiting or in flight here
    inner_step: int = 0
    outer_round: int = 0
    seeking: bool = False  # at an outer-round boundary, looking for a partner
    round_step: int = 0  # inner steps since its last outer round: past half, it accepts a proposal early
    loss: float | None = None  # last stage: EMA of the training loss
    tokens: int = 0  # stage 0: tokens this node has fed into the pipeline
    lost: int = 0  # micro-batches this node gave up on
    partner_rounds: int = 0  # outer rounds averaged with a partner
    local_rounds: int = 0  # outer rounds that found no partner
    last_error: str = ""  # the latest failure, one line, for dashboards
    # False: others cannot open connections to this node (a NAT; peers dialled it back
    # and failed). It then only calls out: nobody routes to it or proposes pairs to it.
    reachable: bool = True
    # Progress over the last minute, so a dashboard can tell training from stuck.
    recent_steps: int = 0  # inner steps taken
    recent_microbatches: int = 0  # micro-batches completed (sent and back, or served)
    data_slot: int = -1  # stage 0 of a prepared dataset: the slot of shards it trains (data/slot_batches.py)

    def to_wire(self) -> dict:
        return asdict(self)

    def compact_wire(self) -> dict:
        """The record as the registry stores it: fields at their default are left out,
        since every reader (``from_wire``, this one and the ones before it) fills them in.
        Each heartbeat is downloaded again by every replica a store or read passes,
        so the ~70 bytes of a training peer's defaults cost many times over."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name in REQUIRED_FIELDS or getattr(self, f.name) != f.default}

    @classmethod
    def from_wire(cls, raw: object) -> PeerRecord:
        if not isinstance(raw, dict):
            raise ProtocolError("registry record is not a map")
        try:
            record = cls(stage=_int(raw["stage"], 0, 1024), spec_hash=_str(raw["spec_hash"]),
                         version=_str(raw["version"]), state=_str(raw.get("state", "training")),
                         throughput=_float(raw.get("throughput", 0.0)),
                         queue=_int(raw.get("queue", 0), 0, 10**6),
                         inner_step=_int(raw.get("inner_step", 0), 0, 10**12),
                         outer_round=_int(raw.get("outer_round", 0), 0, 10**12),
                         seeking=_bool(raw.get("seeking", False)),
                         round_step=_int(raw.get("round_step", 0), 0, 10**12),
                         loss=None if raw.get("loss") is None else _float(raw["loss"]),
                         tokens=_int(raw.get("tokens", 0), 0, 10**18),
                         lost=_int(raw.get("lost", 0), 0, 10**12),
                         partner_rounds=_int(raw.get("partner_rounds", 0), 0, 10**12),
                         local_rounds=_int(raw.get("local_rounds", 0), 0, 10**12),
                         last_error=_str(raw.get("last_error", ""), MAX_ERROR_CHARS),
                         reachable=_bool(raw.get("reachable", True)),
                         recent_steps=_int(raw.get("recent_steps", 0), 0, 10**9),
                         recent_microbatches=_int(raw.get("recent_microbatches", 0), 0, 10**9),
                         data_slot=_int(raw.get("data_slot", -1), -1, 1 << 20))
        except KeyError as exc:
            raise ProtocolError(f"registry record lacks {exc}") from None
        if record.state not in STATES:
            raise ProtocolError(f"unknown peer state {record.state!r}")
        return record


def _int(value: object, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"bad integer field {value!r}")
    return value


def _bool(value: object) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"bad flag {value!r}")
    return value


def _float(value: object) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or abs(value) > 1e12:
        raise ProtocolError(f"bad number field {value!r}")
    return float(value)


def _str(value: object, max_chars: int = MAX_FIELD_CHARS) -> str:
    if not isinstance(value, str) or len(value) > max_chars:
        raise ProtocolError("bad text field")
    return value

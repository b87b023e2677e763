"""What a node does about peers that fail or misbehave, in one place.

- A call to a peer fails (it died, timed out, answered garbage, or sent a poisoned
  update): :meth:`PeerGuard.failed` bans it from routing, pairing and state downloads
  for 5 s, doubling on each failure in a row up to 120 s.
- A stream ends before its answer: :meth:`PeerGuard.stream_closed` forgives the first in
  a row (about one call in a thousand loses its answer to a reset inside the p2pd
  daemons, between healthy peers); the caller bans from the second.
- A caller sends something malformed: :meth:`PeerGuard.fault` logs it once, and after
  ``max_faults`` such requests, each within ``caller_ban_s`` of the one before, its
  streams are closed unread for ``caller_ban_s``
  (:meth:`PeerGuard.admit`, the gate of every stream handler).
- A registry record we cannot use: :meth:`PeerGuard.ignore` logs it once.
- Every refusal is counted by reason (net/refusals.py: a fixed vocabulary), for the
  status JSON and the metrics: a penalty method counts its ``reason`` keyword.
- What a record claims is not proof that its peer exists: anyone can sign records
  with fresh keys. A peer is *verified* once it has answered one of our calls or
  made one we served (:meth:`PeerGuard.reached`); routing and pairing prefer verified
  peers and try at most one unverified peer at a time (:meth:`PeerGuard.probe_set`).

Every table is bounded, whatever number of ids an attacker uses."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from swarm_node.net.refusals import Refusals
from swarm_node.net.transport import short_id

log = logging.getLogger(__name__)

MAX_TRACKED_PEERS = 4096
NOTE_EVERY_S = 60.0  # a peer's repeated notes: one log line a minute at most
POISON_BAN_S = 1800.0  # a partner whose update we rejected stays off this long


@dataclass
class _Ban:
    until: float
    strikes: int


class PeerGuard:
    def __init__(self, *, admits: Callable[[str], bool] = lambda peer: True, max_faults: int = 8,
                 caller_ban_s: float = 600.0, base_ban_s: float = 5.0, max_ban_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic, refusals: Refusals | None = None):
        self.admits = admits  # a closed run's list of allowed peers
        self.refusals = refusals or Refusals()  # by reason; the transport counts into it too
        self.max_faults = max_faults
        self.caller_ban_s = caller_ban_s
        self.base_ban_s, self.max_ban_s = base_ban_s, max_ban_s
        self.clock = clock
        self._bans: dict[str, _Ban] = {}  # peers we call: failed calls
        self._caller_bans: dict[str, float] = {}  # peers that call us: time their ban ends
        # per caller since its last ban: (count, the last's time)
        self._faults: dict[str, tuple[int, float]] = {}
        self._streams_closed: dict[str, int] = {}  # streams ended unanswered in a row
        self._ignored: set[str] = set()
        self._noted: dict[str, float] = {}  # peer -> when we last logged a note about it
        self._poisoned: dict[str, float] = {}  # peer -> when its poison ban ends
        # peers that answered us or called us (insertion-ordered, bounded)
        self._reached: dict[str, None] = {}

    # -- peers we call -------------------------------------------------------------
    def failed(self, peer: str, at_least_s: float = 0.0, reason: str | None = "failed") -> float:
        """A call to ``peer`` failed: ban it; returns the ban's length in seconds (a
        longer ban it already has is kept). Counted under ``reason``; None: the caller
        counted this event already (as a fault)."""
        if reason is not None:
            self.refusals.count(reason)
        return self._ban(peer, at_least_s)

    def _ban(self, peer: str, at_least_s: float) -> float:
        previous = self._bans.pop(peer, None)
        strikes = previous.strikes + 1 if previous else 1
        # no overflow
        length = max(at_least_s, min(self.max_ban_s, self.base_ban_s * 2 ** min(strikes - 1, 30)))
        until = max(self.clock() + length, previous.until if previous else 0.0)
        self._bans[peer] = _Ban(until, strikes)
        _bound(self._bans)
        return until - self.clock()

    def poisoned(self, peer: str, why: str, what: str = "update", reason: str | None = None) -> None:
        """``peer`` sent an update we rejected (out of our scale at the same round), or a
        state that its stage's other replicas disown (``what``): no routing, pairing or
        downloads with it for POISON_BAN_S, logged once. (A short ban let a x1000
        attacker back in 2 minutes later.) Counted as ``reason``, by default
        "bad-state" for a state and "poisoned" for anything else."""
        self.refusals.count(reason or ("bad-state" if what == "state" else "poisoned"))
        self.ignore(peer, f"rejected its {what} ({why}); not pairing with it for {POISON_BAN_S / 60:.0f} min")
        self._ban(peer, POISON_BAN_S)
        self._poisoned[peer] = self.clock() + POISON_BAN_S
        _bound(self._poisoned)

    def is_poisoned(self, peer: str) -> bool:
        """Whether ``peer`` sent a poisoned update within POISON_BAN_S: not a donor either."""
        return self.clock() < self._poisoned.get(peer, 0.0)

    def succeeded(self, peer: str) -> None:
        """A call to ``peer`` worked: its strikes are forgiven once its ban is over."""
        self.reached(peer)
        self._streams_closed.pop(peer, None)
        ban = self._bans.get(peer)
        if ban is not None and self.clock() >= ban.until:
            del self._bans[peer]

    def is_banned(self, peer: str) -> bool:
        return self.banned_for_s(peer) > 0

    def banned_for_s(self, peer: str) -> float:
        """How long ``peer``'s ban still lasts (0: not banned)."""
        ban = self._bans.get(peer)
        return max(0.0, ban.until - self.clock()) if ban is not None else 0.0

    def reached(self, peer: str) -> None:
        """``peer`` exists: it answered a call of ours, or we served one of its calls."""
        self._reached.pop(peer, None)
        self._reached[peer] = None
        _bound(self._reached)

    def is_verified(self, peer: str) -> bool:
        return peer in self._reached

    def probe_set(self, peers: list[str], rng, probe: bool = True) -> list[str]:
        """``peers`` fit to call: the verified ones not banned, and (with ``probe``) at
        most one unverified one, at random (a flood of forged records costs one probe at a time)."""
        usable = [p for p in peers if not self.is_banned(p)]
        verified = [p for p in usable if self.is_verified(p)]
        unverified = [p for p in usable if not self.is_verified(p)]
        return verified + ([rng.choice(unverified)] if unverified and probe else [])

    def stream_closed(self, peer: str) -> bool:
        """A stream to ``peer`` ended before its answer; True from the second in a row."""
        count = self._streams_closed.pop(peer, 0) + 1
        self._streams_closed[peer] = count
        _bound(self._streams_closed)
        return count >= 2

    # -- peers that call us ----------------------------------------------------------
    def fault(self, peer: str, why: str, reason: str | None = "malformed") -> None:
        """``peer`` sent something malformed: log it once, and after repeated faults stop
        serving it for a while. A fault ``caller_ban_s`` after the caller's last one starts
        the count anew: an offender repeats within seconds, while an honest caller on a
        bad link may, once in a long while, look like one (net/stalls.py). Counted under
        ``reason`` (None: the caller counted it), and the ban that starts as "banned"."""
        if reason is not None:
            self.refusals.count(reason)
        self.ignore(peer, why)
        count = self.faults(peer) + 1
        self._faults.pop(peer, None)
        if count >= self.max_faults:
            self.refusals.count("banned")
            self._caller_bans[peer] = self.clock() + self.caller_ban_s
            _bound(self._caller_bans)
            self.note(
                peer,
                f"banning peer {short_id(peer)} for {self.caller_ban_s:.0f} s after {count} bad requests",
                logging.WARNING,
            )
            count = 0
        self._faults[peer] = (count, self.clock())
        _bound(self._faults)

    def faults(self, peer: str) -> int:
        """Bad requests from ``peer`` since its last ban, each within ``caller_ban_s`` of
        the one before."""
        count, last = self._faults.get(peer, (0, 0.0))
        return count if self.clock() - last < self.caller_ban_s else 0

    def admit(self, peer: str) -> bool:
        """Stream handlers' gate: on a closed run's list, and not banned for faults."""
        until = self._caller_bans.get(peer)
        if until is not None and self.clock() >= until:
            del self._caller_bans[peer]
            until = None
        return until is None and self.admits(peer)

    def note(self, peer: str, what: str, level: int = logging.INFO) -> None:
        """Log ``what`` about ``peer``, at most one line a minute per peer (with the first
        "ignoring" line): an offender must not fill the log."""
        last = self._noted.pop(peer, None)
        if last is not None and self.clock() - last < NOTE_EVERY_S:
            self._noted[peer] = last
            return
        self._noted[peer] = self.clock()
        _bound(self._noted)
        log.log(level, "%s", what)

    def ignore(self, peer: str, why: str, reason: str | None = None) -> None:
        """Log once per peer (bounded: at worst a peer is logged a second time); counted
        under ``reason`` when one is given (the penalties above log through here, and
        count for themselves)."""
        if reason is not None:
            self.refusals.count(reason)
        if peer not in self._ignored:
            if len(self._ignored) >= MAX_TRACKED_PEERS:
                self._ignored.clear()
            self._ignored.add(peer)
            self._noted[peer] = self.clock()  # its next line waits a minute
            _bound(self._noted)
            log.warning("ignoring peer %s: %s", short_id(peer), why)


def _bound(table: dict) -> None:
    while len(table) > MAX_TRACKED_PEERS:
        table.pop(next(iter(table)))

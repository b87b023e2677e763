"""Finding a partner for one outer round, with no global barrier.

The rule (symmetric, tolerant of joins, leaves and odd counts):

1. When a node finishes its H-th inner step of a round it becomes SEEKING and
   announces ``seeking`` in its registry record.
2. While SEEKING it sends an exchange request to a random live peer of its stage
   (peers that announce ``seeking`` first), and meanwhile accepts requests.
3. A node accepts a request only while SEEKING. Accepting or initiating moves it to
   EXCHANGING, where every other request is answered ``busy``. So each node is in at
   most one exchange per round, and a pair is formed exactly when one side's request
   reaches the other while it is still SEEKING.
4. Refusals (``busy``, ``not-ready``) and failures lead to a short random back-off and
   another random choice; two nodes that requested each other at the same instant
   both get ``busy`` and the random back-off separates them.
5. At the round deadline a node that found nobody takes the local-only step. An odd
   node out therefore loses at most one deadline, and a node whose partner died
   mid-exchange loses at most its request's timeout. A node with no live (unbanned)
   peer left takes the local-only step at once.
6. (In the node) a peer that is not at its boundary but is past half of its round
   accepts a request by taking its round early. Without this, two nodes whose
   boundaries fall at alternating times would each wait out the deadline while the
   other trains, and never meet.

The coordinator does not do I/O itself: it is given ``send(peer, payload)`` and
``candidates()`` so it can run in-process under test.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from swarm_node.errors import PeerError, PeerTimeout

log = logging.getLogger(__name__)

MIN_REQUEST_S = 0.25  # do not start an exchange that could not finish anyway


class PairState(enum.Enum):
    IDLE = "idle"
    SEEKING = "seeking"
    EXCHANGING = "exchanging"


@dataclass
class PairResult:
    partner: str
    payload: Any  # the partner's (phi, Delta) as received
    initiated: bool


class Refused(Exception):
    """The peer answered but would not pair now (busy or not ready)."""


async def backoff(wake: asyncio.Event, rng: random.Random, bounds_s: tuple[float, float], deadline: float) -> None:
    """A random pause before the next attempt, cut short when ``wake`` is set or the
    round deadline comes."""
    pause = min(rng.uniform(*bounds_s), max(0.0, deadline - time.monotonic()))
    try:
        await asyncio.wait_for(wake.wait(), timeout=pause)
    except TimeoutError:
        pass


class PairingCoordinator:
    def __init__(self, *, round_timeout_s: float, request_timeout_s: float,
                 backoff_s: tuple[float, float] = (0.05, 0.3), rng: random.Random | None = None):
        self.round_timeout_s = round_timeout_s
        self.request_timeout_s = request_timeout_s
        self.backoff_s = backoff_s
        self.rng = rng or random.Random()
        self.state = PairState.IDLE
        self.round = -1
        self.seeking = asyncio.Event()  # set while a round is open for requests
        self._own_payload: Any = None
        self._accepted: PairResult | None = None
        self._accepted_event = asyncio.Event()

    def on_request(self, remote: str, payload: Any) -> Any:
        """Handle a partner's request: returns our payload, or raises Refused."""
        if self.state is not PairState.SEEKING:
            raise Refused("busy" if self.state is PairState.EXCHANGING else "not-ready")
        self.state = PairState.EXCHANGING
        self._accepted = PairResult(remote, payload, initiated=False)
        self._accepted_event.set()
        return self._own_payload

    async def run_round(self, round_no: int, own_payload: Any,
                        candidates: Callable[[], list[tuple[str, bool]]],
                        send: Callable[[str, Any, float], Awaitable[Any]],
                        on_peer_failure: Callable[[str], None] = lambda peer: None,
                        expect_request: bool = False) -> PairResult | None:
        """Seek a partner until the deadline. ``candidates()`` lists (peer, is_seeking);
        ``send(peer, payload, timeout)`` returns the partner's payload or raises
        Refused / PeerError. ``expect_request``: a peer is already waiting to pair with
        us, so seek even if no candidate is known yet."""
        self.round = round_no
        self._own_payload = own_payload
        self._accepted = None
        self._accepted_event.clear()
        if not expect_request and not candidates():
            self._own_payload = None
            return None
        self.state = PairState.SEEKING
        self.seeking.set()
        deadline = time.monotonic() + self.round_timeout_s
        try:
            while True:
                if self._accepted is not None:
                    return self._accepted
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                live = candidates()
                if not live and not expect_request:
                    return None  # everyone left or is banned: waiting cannot help
                peer = self._pick(live) if remaining >= MIN_REQUEST_S else None
                if peer is not None:
                    self.state = PairState.EXCHANGING
                    timeout = min(self.request_timeout_s, remaining)
                    try:
                        reply = await send(peer, own_payload, timeout)
                        return PairResult(peer, reply, initiated=True)
                    except Refused:
                        pass
                    except PeerTimeout as exc:
                        if timeout >= self.request_timeout_s:  # cut short by our own deadline: not its fault
                            log.info("round %d: partner %s timed out: %s", round_no, peer[-6:], exc)
                            on_peer_failure(peer)
                    except PeerError as exc:
                        log.info("round %d: partner %s failed: %s", round_no, peer[-6:], exc)
                        on_peer_failure(peer)
                    self.state = PairState.SEEKING
                if self._accepted is not None:
                    return self._accepted
                await backoff(self._accepted_event, self.rng, self.backoff_s, deadline)
        finally:
            self.state = PairState.IDLE
            self.seeking.clear()
            self._own_payload = None

    def _pick(self, candidates: list[tuple[str, bool]]) -> str | None:
        if not candidates:
            return None
        seeking = [peer for peer, is_seeking in candidates if is_seeking]
        return self.rng.choice(seeking or [peer for peer, _ in candidates])

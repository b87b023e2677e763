"""Finding a partner for one outer round, with no global barrier.

The rule (symmetric, tolerant of joins, leaves and odd counts):

1. When a node finishes its H-th inner step of a round it becomes SEEKING and
   announces ``seeking`` in its registry record.
2. While SEEKING it *proposes* to a random live peer of its stage (peers that announce
   ``seeking`` first, then those whose record says they are past half of their round,
   who accept by taking their round early (rule 7), then the rest), and meanwhile
   accepts proposals. A proposal is a few bytes; only
   an accepted one is followed by the (phi, Delta) payload, so a refusal costs one
   round trip, not two model-sized transfers. (Sending the payload with the request
   made every refusal cost a full upload, and with large stages the swarm spent its
   rounds uploading to peers that were already taken.)
3. A node accepts a proposal only while SEEKING, and is then RESERVED for that peer:
   every other proposal is answered ``busy`` and only the reserved peer's payload is
   taken (the reserved peer asking again, its first answer lost, is told yes again).
   The payload moves it to EXCHANGING. So each node is in at most one exchange per
   round, and both sides of a pair agree on it before any payload moves.
4. Two nodes that propose to each other at the same instant pair at once: the one with
   the larger peer id accepts the other's proposal and refuses the other way round, so
   the smaller id sends the payload. Other refusals (``busy``, ``not-ready``) and
   failures lead to a short random back-off and another random choice. A ``not-ready``
   may say in how many seconds its round will be past half (rule 7): that peer is
   not asked again before then, and is asked first then (at most ETA_CLAIMS times a
   round, so false claims cost a few proposals). Such a refusal is followed by the
   next proposal at once (no back-off: nobody contends, and the refuser is set aside);
   a node whose every candidate said "later" waits for the first of them, open to
   proposals, instead of asking the same peers again.
5. A reservation lasts until the reserved peer's payload has had its full exchange
   timeout, or until that peer withdraws its proposal: a proposer whose proposal timed
   out unanswered, or that stops before its payload is out, says so (``withdraw``), and
   the partner goes back to seeking at once. A proposer that dies without a word costs
   its partner the whole reservation. A reserved node holds its round open past the
   round deadline for that time.
6. At the round deadline a node that found nobody takes the local-only step. An odd
   node out therefore loses at most one deadline. A node with no live (unbanned) peer
   left takes the local-only step at once.
7. (In the node) a peer that is not at its boundary but is past half of its round
   accepts a proposal by taking its round early. Without this, two nodes whose
   boundaries fall at alternating times would each wait out the deadline while the
   other trains, and never meet. The round it opens so is held for that proposer
   (``hold_for``): it starts reserved for it rather than seeking, since a round opened
   seeking may propose to some other peer in the same loop turn, before the handler
   that opened it can answer, and then refuse its own proposer ``busy``.

The coordinator does not do I/O itself: it is given ``propose(peer, timeout)``,
``send(peer, payload, timeout)`` and ``candidates()`` so it can run in-process under test.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from swarm_node.errors import PeerError, PeerTimeout

log = logging.getLogger(__name__)

MIN_REQUEST_S = 0.25  # do not propose when the round could not use the answer anyway
# How likely a candidate is to accept a proposal now, as its record says: the higher are
# asked first. Rounds that pair pull partners into phase, so in a large stage most peers
# are early in their rounds when one reaches its boundary: asked at random, three in
# four answered not-ready, ten round trips a partner (bench/scale).
# HINTED: a verified peer of our view heard seeking in the last seconds (it proposed to
# us, or a refuser named it: gossip/seekers.py), fresher than any record.
UNLIKELY, PAST_HALF, SEEKING_NOW, HINTED = 0, 1, 2, 3
READY_NOW = 4  # it told us itself, refusing this round, that it would accept by now (rule 4)
ETA_CLAIMS = 3  # "ready in" claims believed of one peer a round (its pace may be a little off)
ETA_WAIT_S = 1.0  # at most this long a wait for a peer that said "later" (new candidates may come meanwhile)


def now() -> float:
    """The running loop's clock, the one its timers (``asyncio.timeout``, ``sleep``) use:
    ``time.monotonic()`` on asyncio's own loop (in whole milliseconds on uvloop), and a
    virtual clock under test, which the deadlines, reservations and back-offs here then
    follow too."""
    return asyncio.get_running_loop().time()


class PairState(enum.Enum):
    IDLE = "idle"
    SEEKING = "seeking"
    PROPOSING = "proposing"  # our proposal is in flight
    RESERVED = "reserved"  # we accepted a proposal and wait for that peer's payload
    EXCHANGING = "exchanging"  # a payload is moving, either way


@dataclass
class PairResult:
    partner: str
    payload: Any  # the partner's (phi, Delta) as received
    initiated: bool


class Refused(Exception):
    """The peer answered but would not pair now (busy or not ready); ``ready_in_s``: in
    how many seconds it says it will accept (a claim)."""

    def __init__(self, why: str = "refused", ready_in_s: float | None = None):
        super().__init__(why)
        self.ready_in_s = ready_in_s


async def backoff(wake: asyncio.Event, rng: random.Random, bounds_s: tuple[float, float],
                  deadline: float) -> None:
    """A random pause before the next attempt, cut short when ``wake`` is set or the
    round deadline comes."""
    pause = min(rng.uniform(*bounds_s), max(0.0, deadline - now()))
    await wait_set(wake, pause)


async def wait_set(event: asyncio.Event, timeout_s: float) -> None:
    """Wait until ``event`` is set or ``timeout_s`` passes. Not ``asyncio.wait_for``: on
    Python 3.11 it swallows a cancellation that lands as the event is set, and a
    cancelled round would then run on to its deadline."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass


class PairingCoordinator:
    def __init__(self, *, round_timeout_s: float, request_timeout_s: float, propose_timeout_s: float = 5.0,
                 own_id: str = "", backoff_s: tuple[float, float] = (0.05, 0.3),
                 rng: random.Random | None = None):
        self.round_timeout_s = round_timeout_s
        self.request_timeout_s = request_timeout_s  # the payload exchange's deadline
        self.propose_timeout_s = propose_timeout_s
        self.own_id = own_id  # breaks the tie when two proposals cross
        self.backoff_s = backoff_s
        self.rng = rng or random.Random()
        self.state = PairState.IDLE
        self.round = -1
        self.seeking = asyncio.Event()  # set while a round is open for proposals
        self._own_payload: Any = None
        self._counterpart: str | None = None  # whom we propose to, are reserved for, or exchange with
        self._reserved_until = 0.0
        self._accepted: PairResult | None = None
        # peer -> when it said it accepts, this round (inf: claim spent)
        self._ready_at: dict[str, float] = {}
        self._claims: dict[str, int] = {}  # peer -> how many such claims it made this round
        # a proposer that opened our round early: the round starts reserved for it
        self._held_for: str | None = None
        self._unconfirmed: str | None = None  # reserved by a hold, its proposal not yet answered yes
        self._changed = asyncio.Event()  # a proposal was accepted, a payload arrived, or a reservation ended
        self.abandoned: str | None = None  # a peer our cancelled proposal or payload left reserved for us

    # -- the answering side (called by the network handlers) -------------------------
    def on_propose(self, remote: str) -> None:
        """Accept ``remote``'s proposal (we are then reserved for it) or raise Refused."""
        if self.state is PairState.RESERVED and self._counterpart == remote:
            if self._unconfirmed == remote:
                self._unconfirmed = None  # the round held for it: this is the yes it is told
            return  # or asked again (its first answer was lost to a stream reset): still yes
        crossed = (self.state is PairState.PROPOSING and self._counterpart == remote
                   and self.own_id and self.own_id > remote)
        if self.state is not PairState.SEEKING and not crossed:
            raise Refused("not-ready" if self.state is PairState.IDLE else "busy")
        self._reserve(remote)

    def hold_for(self, remote: str) -> None:
        """``remote``'s proposal is opening our round early (rule 7): the round starts
        reserved for it, and its proposal, answered once the round is open, is a yes.
        The caller ends with ``drop_hold`` whatever happens."""
        if self.state is PairState.IDLE:
            self._held_for = remote

    def drop_hold(self, remote: str) -> None:
        """The proposal that opened our round has been answered, or never will be (our
        round did not open in time, or the handler was cut short): a hold not taken is
        dropped, and a reservation it made that the proposer was never told of is
        released rather than left to lapse."""
        if self._held_for == remote:
            self._held_for = None
        if self._unconfirmed == remote:
            self._unconfirmed = None
            self.release(remote)

    def _reserve(self, remote: str) -> None:
        self.state = PairState.RESERVED
        self._counterpart = remote
        self._reserved_until = now() + self.propose_timeout_s + self.request_timeout_s
        self._changed.set()

    def claim(self, remote: str) -> None:
        """``remote``'s payload has arrived: it must hold our reservation. The exchange is
        then under way until :meth:`complete` or :meth:`release`."""
        if self.state is not PairState.RESERVED or self._counterpart != remote:
            raise Refused("no-reservation")
        self.state = PairState.EXCHANGING
        self._reserved_until = now() + self.request_timeout_s  # the node's handler is cut by then

    def complete(self, remote: str, payload: Any) -> None:
        """The claimed payload checked out: the pair is made."""
        if (
            self.state is not PairState.EXCHANGING
            or self._counterpart != remote
            or self._accepted is not None
        ):
            raise Refused("no-reservation")
        self._accepted = PairResult(remote, payload, initiated=False)
        self._changed.set()

    def may_fetch(self, remote: str) -> bool:
        """Whether ``remote`` may have our payload now: it holds our reservation, or we
        paired with it this round."""
        if self._accepted is not None:
            return self._accepted.partner == remote
        return self.state in (PairState.RESERVED, PairState.EXCHANGING) and self._counterpart == remote

    def withdrawn(self, remote: str) -> bool:
        """``remote`` takes back its proposal: it will not send its payload (its proposal
        timed out before our yes reached it, or it is leaving). A round held or reserved
        for it goes back to seeking at once instead of waiting out the reservation (a
        joiner stopped right after our yes held a stage-0 peer's steps for 35 s, and
        that peer fell 60 rounds behind its stage). A payload already claimed is not
        given up. Returns whether a reservation was released."""
        if self._held_for == remote:
            self._held_for = None
        if self.state is not PairState.RESERVED or self._counterpart != remote:
            return False
        log.info("round %d: %s took back its proposal; seeking again", self.round, remote[-6:])
        self._unconfirmed = None
        self._back_to_seeking()
        return True

    def release(self, remote: str) -> None:
        """The reserved peer's payload was refused or bad: seek again."""
        if self._counterpart == remote and self._accepted is None and self.state in (PairState.RESERVED,
                                                                                     PairState.EXCHANGING):
            self._back_to_seeking()

    async def answer(self, remote: str, check: Callable[[], Awaitable[Any]]) -> None:
        """``remote``'s payload has arrived: claim the reservation (before anything is
        decoded), run ``check`` for the partner's payload, and complete the pair. If the
        check raises, or is cut short, the reservation is released."""
        self.claim(remote)
        try:
            payload = await check()
        except BaseException:
            self.release(remote)
            raise
        self.complete(remote, payload)

    # -- the seeking side -----------------------------------------------------------
    async def run_round(self, round_no: int, own_payload: Any,
                        candidates: Callable[[], list[tuple[str, int]]],
                        propose: Callable[[str, float], Awaitable[None]],
                        send: Callable[[str, Any, float], Awaitable[Any]],
                        on_peer_failure: Callable[[str, str], None] = lambda peer, why: None,
                        expect_request: bool = False) -> PairResult | None:
        """Seek a partner until the deadline. ``candidates()`` lists (peer, how likely it
        accepts now: UNLIKELY, PAST_HALF or SEEKING_NOW);
        ``propose(peer, timeout)`` returns if the peer reserved itself for us and raises
        Refused / PeerError otherwise; ``send(peer, payload, timeout)`` returns the
        partner's payload or raises the same. ``expect_request``: a peer is already
        waiting to pair with us, so seek even if no candidate is known yet."""
        self.round = round_no
        self._own_payload = own_payload
        self._accepted = None
        self._counterpart = None
        self._ready_at, self._claims = {}, {}
        self._changed.clear()
        if not expect_request and not candidates():
            self._own_payload = None
            return None
        self.state = PairState.SEEKING
        held, self._held_for = self._held_for, None
        if held is not None:
            self._reserve(held)
            self._unconfirmed = held
        self.seeking.set()
        deadline = now() + self.round_timeout_s
        try:
            while True:
                if self._accepted is not None:
                    return self._accepted
                if self.state in (PairState.RESERVED, PairState.EXCHANGING):
                    await self._await_reserved_peer(round_no)
                    continue
                remaining = deadline - now()
                if remaining <= 0:
                    return None
                live = candidates()
                if not live and not expect_request:
                    return None  # everyone left or is banned: waiting cannot help
                peer = self._pick(live) if remaining >= MIN_REQUEST_S else None
                if peer is not None:
                    result = await self._initiate(round_no, peer, remaining, propose, send, on_peer_failure)
                    if result is not None:
                        return result
                if peer is not None and now() < self._ready_at.get(peer, 0.0) < math.inf:
                    continue  # it said when it accepts and is set aside till then: the next peer at once
                if self.state is PairState.SEEKING and self._accepted is None:
                    self._changed.clear()
                    ready_at = min((t for t in self._ready_at.values() if now() < t < math.inf), default=None)
                    if peer is None and live and ready_at is not None:  # all said "later": wait for the first
                        await wait_set(
                            self._changed, min(ready_at - now(), ETA_WAIT_S, max(0.0, deadline - now()))
                        )
                    else:
                        await backoff(self._changed, self.rng, self.backoff_s, deadline)
        finally:
            self.state = PairState.IDLE
            self._unconfirmed = None
            self.seeking.clear()
            self._own_payload = None
            self._counterpart = None

    async def _initiate(self, round_no: int, peer: str, remaining: float,
                        propose: Callable[[str, float], Awaitable[None]],
                        send: Callable[[str, Any, float], Awaitable[Any]],
                        on_peer_failure: Callable[[str, str], None]) -> PairResult | None:
        """Propose to ``peer`` and, if it accepts, exchange payloads. Returns None when
        this attempt made no pair (we may have been reserved by someone meanwhile)."""
        self.state = PairState.PROPOSING
        self._counterpart = peer
        timeout = min(self.propose_timeout_s, remaining)
        try:
            await self._until_sent_or_abandoned(peer, propose(peer, timeout))
        except Refused as exc:
            if exc.ready_in_s is not None and self._claims.get(peer, 0) < ETA_CLAIMS:
                self._claims[peer] = self._claims.get(peer, 0) + 1
                self._ready_at[peer] = now() + exc.ready_in_s
            if self.state is PairState.PROPOSING:
                self._back_to_seeking()
            return None  # else a crossed proposal reserved us for this peer: wait for its payload
        except PeerError as exc:
            if self.state is PairState.PROPOSING:
                self._back_to_seeking()
            # not cut by our deadline
            if not isinstance(exc, PeerTimeout) or timeout >= self.propose_timeout_s:
                on_peer_failure(peer,
                                f"round {round_no}: partner {peer[-6:]} failed to answer a proposal: {exc}")
            return None
        # Accepted: the partner holds its round open for our payload, so the exchange
        # gets its whole timeout even past our own round deadline.
        self.state = PairState.EXCHANGING
        try:
            return PairResult(peer, await self._until_sent_or_abandoned(
                peer, send(peer, self._own_payload, self.request_timeout_s)), initiated=True)
        except Refused:
            pass
        except PeerError as exc:
            on_peer_failure(peer, f"round {round_no}: partner {peer[-6:]} failed mid-exchange: {exc}")
        self._back_to_seeking()
        return None

    async def _until_sent_or_abandoned(self, peer: str, call: Awaitable[Any]) -> Any:
        """``call`` (our proposal to ``peer``, or our payload after its yes); if it is
        cancelled (the node stops), ``peer`` may hold a reservation for us: it is named
        in ``abandoned`` for the node to withdraw before it goes."""
        try:
            return await call
        except asyncio.CancelledError:
            self.abandoned = peer
            raise

    async def _await_reserved_peer(self, round_no: int) -> None:
        """Reserved: wait for that peer's payload to arrive and be checked, or for the
        reservation to lapse."""
        if now() >= self._reserved_until:
            log.info("round %d: %s reserved us but its payload did not arrive in time", round_no,
                     (self._counterpart or "")[-6:])
            self._back_to_seeking()
            return
        self._changed.clear()
        await wait_set(self._changed, self._reserved_until - now())

    def _back_to_seeking(self) -> None:
        self.state = PairState.SEEKING
        self._counterpart = None
        self._changed.set()

    def _pick(self, candidates: list[tuple[str, int]]) -> str | None:
        at = now()
        ranked = []
        for peer, likely in candidates:
            ready_at = self._ready_at.get(peer)
            if ready_at is None:
                ranked.append((peer, likely))
            elif ready_at <= at:
                ranked.append((peer, READY_NOW))
            # else: it said when it accepts; not before
        if not ranked:
            return None
        best = max(likely for _, likely in ranked)
        peer = self.rng.choice([peer for peer, likely in ranked if likely == best])
        if best == READY_NOW:
            self._ready_at[peer] = math.inf  # its claim is spent: not asked again unless it makes another
        return peer

"""The outer round: find a partner (NoLoCo) or gather the stage (DiLoCo), swap (phi,
Delta) with it, and apply the outer step.

What it owns: the round, from its opening (our payload encoded once, ``seeking``
announced in our record: a one-key registry's, or a sharded one's heartbeats) to the
outer step with the partner or the local-only step, and the inner steps' wait for the
partner's Delta first when the last exchange outlasted its steps; the pairing
proposals (``/swarm-node/pair``), made by the pairing through us and answered here; and
pulling our round forward when a peer at its boundary proposes while we are past half
of ours, so that nodes whose boundaries alternate still meet. Whom a round exchanges
with is its pairing's (gossip/round_pairing.py: NoLoCo's pairs or DiLoCo's group behind
one interface, so nothing here asks which); the payloads themselves, both ways, and the
checks on what comes are gossip/payloads.py's.

A partner that fails is backed off (net/guard.py) and the round goes on without it; a
round that finds nobody takes the local-only step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from swarm_node.errors import PeerError, PeerTimeout, ProtocolError, StreamClosed
from swarm_node.gossip.exchange_times import ExchangeTimes
from swarm_node.gossip.pairing import HINTED, SEEKING_NOW, PairState, Refused, now
from swarm_node.gossip.partner_check import PartnerCheck
from swarm_node.gossip.payloads import SERVED_AT_ONCE, Payload, PayloadState, PayloadSwap, Tensors
from swarm_node.gossip.round_outcome import RoundOutcome, count_round
from swarm_node.gossip.round_pairing import RoundCalls, RoundPairing, round_pairing
from swarm_node.gossip.seekers import Seekers
from swarm_node.net import protocols
from swarm_node.net.transport import ServeLimits
from swarm_node.node_services import NodeServices
from swarm_node.train.rounds import RoundGate, force_round_if_ready
from swarm_node.train.worker import OpenRound
from swarm_node.wire.frames import encode_frame
from swarm_node.wire.messages import (
    CONTROL_MAX_BYTES,
    answer_is_yes,
    check_pair_request,
    refusal,
    refusal_hints,
    refusal_ready_in_s,
)

log = logging.getLogger(__name__)

# further off than a round's deadline, a "ready in" is of no use to the proposer
READY_IN_WORTH_SAYING_S = 30.0
PROPOSE_TIMEOUT_S = 5.0  # a pairing proposal is a few bytes: no answer in this time means the peer is unwell
# taking a proposal back is worth a second, no more: the partner's reservation lapses anyway
WITHDRAW_TIMEOUT_S = 1.0
MAX_WITHDRAWN_TRACKED = 64


class OuterState(PayloadState, Protocol):
    """What the round needs of a stage besides its payloads (train/worker.py's StageWorker
    has it all)."""

    def open_round(self, overlapped: bool) -> OpenRound: ...

    def close_round(self, others: list[tuple[Tensors, Tensors]]) -> None: ...

    def outer_round_due(self) -> bool: ...

    def round_fraction(self) -> float: ...

    def can_round_early(self) -> bool: ...

    def force_round(self) -> None: ...


class OuterExchange:
    def __init__(self, *, spec_hash: str, method: str, times: ExchangeTimes, state: OuterState,
                 services: NodeServices, gate: RoundGate, candidates: Callable[[], list[tuple[str, int]]],
                 callers_expected: Callable[[], bool], announce: Callable[[], Awaitable[None]],
                 stopping: asyncio.Event, own_id: str, max_update_ratio: float = 3.0,
                 gate_holds_steps: bool = True, link_bytes_s: Callable[[], float | None] = lambda: None):
        self.spec_hash = spec_hash
        self.times = times
        self.state = state
        self.compute, self.transport, self.guard, self.stats = (services.compute, services.transport,
                                                                services.guard, services.stats)
        self.gate = gate
        # whether the gate holds this node's own steps: stage 0, which draws the micro-batches
        # (or a one-stage node); a later stage computes what its upstream sends, gate or not
        self.gate_holds_steps = gate_holds_steps
        # what our uplink carries of the pipeline, bytes a second, as we measured it (None: not yet)
        self.link_bytes_s = link_bytes_s
        # stage 0 holds its micro-batches to one while our payload moves (train/pipeline.py)
        gate.payload_on_link = self.payload_on_link
        # callable, unbanned peers of our stage: (peer, how likely it accepts now)
        self.candidates = candidates
        self.callers_expected = callers_expected  # peers that cannot be called may call us this round
        self.announce = announce  # publish our record now (it says whether we seek)
        self.stopping = stopping
        self.check = PartnerCheck(max_update_ratio, schedule=state)
        self.pairing: RoundPairing = round_pairing(
            method, round_timeout_s=times.round_timeout_s, exchange_s=times.exchange_s, link_s=times.link_s,
            propose_timeout_s=PROPOSE_TIMEOUT_S, own_id=own_id, served_at_once=SERVED_AT_ONCE)
        self.payloads = PayloadSwap(spec_hash=spec_hash, state=state, services=services, pairing=self.pairing,
                                    check=self.check, exchange_s=self.pairing.served_s, serve_s=times.most_s,
                                    both_at_once=times.both_at_once,
                                    round_early=self.maybe_round_early, on_delta=self._delta_landed)
        self.own_id = own_id
        self.seekers = Seekers(now)  # peers heard seeking lately: whom we try first, and name in refusals
        self.last: RoundOutcome | None = None
        self._outcome = RoundOutcome(-1)
        self._alone = False  # the last round found nobody else in the stage
        self._round_opened_at: float | None = None
        # the last paired exchange: how long it took from its round's open, and when that
        # round's steps began (the next boundary ends them): what the next round may wait first
        self._last_exchange_s: float | None = None
        self._steps_began_at: float | None = None
        self._delta_in = asyncio.Event()  # the open round's partner Delta has landed
        self._withdrawn: dict[str, int | None] = {}  # peer -> the round whose proposal it took back

    @property
    def seeking(self) -> bool:
        return self.pairing.state.value in ("seeking", "proposing")

    def payload_on_link(self) -> bool:
        """Whether a payload of this round is moving now, ours or the partner's: from a
        reservation or our proposal's yes to the pair made."""
        return self.pairing.state in (PairState.RESERVED, PairState.EXCHANGING)

    @property
    def behind(self) -> bool:
        """A partner rounds ahead was out of our scale: the node should catch up (and
        clears this once it has)."""
        return self.payloads.behind

    @behind.setter
    def behind(self, value: bool) -> None:
        self.payloads.behind = value

    async def serve(self, transport, authorize: Callable[[str], bool]) -> None:
        """Answer the payload protocols (gossip/payloads.py) and proposals."""
        await self.payloads.serve(transport, authorize)
        # two a peer: its withdrawal may come while its proposal is still being answered
        await transport.serve(protocols.PAIR, self.handle_propose,
                              ServeLimits(max_request_bytes=CONTROL_MAX_BYTES, max_concurrent=8,
                                          max_per_peer=2, handler_timeout_s=PROPOSE_TIMEOUT_S),
                              authorize=authorize)

    # -- the seeking side --------------------------------------------------------------
    async def run_round(self) -> RoundOutcome:
        """One outer round, from our payload to the outer step (partner or local-only)."""
        started = now()
        self._delta_in = asyncio.Event()
        opened = await self.compute(self.state.open_round, self.times.overlapped)
        round_no = opened.round_no
        # the next round's steps count from here: its pace (_ready_in_s)
        self._round_opened_at = opened_at = now()
        self._outcome = outcome = RoundOutcome(round_no, started_at=started)
        wait_first_s = self._wait_first_s() if opened.theta_start is not None else 0.0
        self._steps_began_at = None
        if opened.theta_start is not None and wait_first_s == 0:
            self.gate.resume_steps()  # what we send is taken: inner steps go on beside the exchange
            self._steps_began_at = self._round_opened_at
        await self.compute(self.payloads.note_own_delta, opened.fraction, opened.steps)
        reply = await self.compute(self.payloads.encode, round_no, opened.wire, opened.steps)
        outcome.prepare_s = now() - started
        callers = self.callers_expected()
        had_company = callers or bool(self.candidates())
        outcome.alone = not had_company
        announcing = asyncio.create_task(self._announce_seeking())
        resuming = (asyncio.create_task(self._resume_steps(opened_at + wait_first_s, outcome))
                    if wait_first_s > 0 else None)
        self.payloads.offer = reply
        # this round's deadline, from our link as measured now
        self.pairing.request_timeout_s = self.times.deadline_s(self.link_bytes_s())
        self.payloads.exchange_s = self.pairing.served_s
        try:
            others = await self._gather(round_no, reply, expect_request=self.gate.requested or callers)
        finally:
            # the round may end before the record is out (the caller publishes after) or
            # before the Delta came (the steps go on now)
            helpers = [task for task in (announcing, resuming) if task is not None]
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            self.payloads.withdraw()
        self._last_exchange_s = now() - opened_at if others else None  # steps could have begun at the open
        self.payloads.keep_for([peer for peer, _ in others], reply)
        closing = now()
        if others and outcome.partner_at is not None:
            outcome.exchange_s = closing - outcome.partner_at
        await self.compute(self.state.close_round, [payload for _, payload in others])
        outcome.partners = [peer for peer, _ in others]
        outcome.ended_at = now()
        outcome.close_s = outcome.ended_at - closing
        outcome.seconds = outcome.ended_at - started
        self._alone = count_round(self.stats, outcome, had_company, alone_before=self._alone)
        self.last = outcome
        return outcome

    def _wait_first_s(self) -> float:
        """How long the steps may wait for the partner's Delta before they start: by how far
        the last exchange outlasted the steps it would have had without a wait (its time
        from the open against the steps' time to this boundary), else 0. Such steps stand
        at the boundary anyway, so spent first the wait costs no time and lets them start
        from the pair's Delta step (ALGORITHM.md 3.1, "The wait comes first")."""
        if not self.gate_holds_steps or not self.pairing.delta_ahead:  # no Delta lands before the round ends
            return 0.0
        took_s, began_at, boundary_at = self._last_exchange_s, self._steps_began_at, self.gate.shut_at
        if took_s is None or began_at is None or boundary_at is None or boundary_at < began_at:
            return 0.0
        return max(0.0, took_s - (boundary_at - began_at))

    async def _resume_steps(self, until: float, outcome: RoundOutcome) -> None:
        """Lets the inner steps go on beside the exchange once the partner's Delta is in,
        or at ``until`` (the loop's clock), or when the round ends, whichever comes first."""
        try:
            async with asyncio.timeout_at(until):
                await self._delta_in.wait()
        except TimeoutError:
            pass
        finally:
            self.gate.resume_steps()
            outcome.waited_first_s = now() - self._round_opened_at
            self._round_opened_at = self._steps_began_at = now()  # the pace counts from the first step

    def _delta_landed(self, fetched: bool) -> None:
        """The partner's Delta is in, checked and landed (gossip/payloads.py): steps held
        for it may start. ``fetched``: we fetched it, as the pair's caller."""
        self._delta_in.set()
        if fetched and self._outcome.partner_at is not None:
            self._outcome.delta_in_s = now() - self._outcome.partner_at

    async def _gather(self, round_no: int, reply: Payload, expect_request: bool) -> list[tuple[str, Any]]:
        calls = RoundCalls(candidates=self._pairing_candidates, propose=self._send_proposal,
                           send=self.payloads.send, on_peer_failure=self._partner_failed,
                           agreed=self._partner_agreed)
        return await self.pairing.gather(round_no, reply, calls, expect_request)

    def _partner_agreed(self) -> None:
        self._outcome.partner_at = now()

    def _pairing_candidates(self) -> list[tuple[str, int]]:
        """Our view's candidates, those heard seeking lately first: only verified peers,
        so a hint reorders whom we would ask anyway and never brings in a new one."""
        ranked = self.candidates()
        fresh = self.seekers.fresh()
        if not fresh:
            return ranked
        return [(peer, HINTED if peer in fresh and self.guard.is_verified(peer) else likely)
                for peer, likely in ranked]

    def _partner_failed(self, peer: str, what: str) -> None:
        """Backed off (a poisoner's longer ban is kept), logged at most once a minute a peer."""
        self.guard.failed(peer)
        self.guard.note(peer, what)

    async def _announce_seeking(self) -> None:
        """Publish our record as soon as the round is open, so that peers choosing a
        partner prefer us now rather than at the next heartbeat."""
        await self.pairing.seeking.wait()
        await self.announce()

    async def meet_a_seeking_peer(self) -> None:
        """Nobody can call a node behind a NAT, so nobody can pull its round forward the
        way a proposal does. It looks instead: a peer of its stage that announces
        ``seeking`` is waiting for a partner right now, and if we are past half of our
        round we take ours early and propose."""
        if self.pairing.meets_seekers() and any(likely >= SEEKING_NOW for _, likely in self.candidates()):
            await self.maybe_round_early(wait_s=0.0)

    async def maybe_round_early(self, wait_s: float, for_peer: str | None = None) -> None:
        """A partner is at its boundary and we are past half of our round: start our
        round now (steps stop at once), and let the request in when we are seeking
        (within ``wait_s``: the caller's deadline must leave room for our answer).
        ``for_peer``: the proposer that asks; the round opens reserved for it."""
        if self.gate.in_round or self.stopping.is_set():
            return
        if not await self.compute(force_round_if_ready, self.state):
            return
        if for_peer is not None:
            self.pairing.hold_for(for_peer)  # handle_propose drops it once it has answered
        self.gate.open_early()
        try:
            async with asyncio.timeout(wait_s):
                await self.pairing.seeking.wait()
        except TimeoutError:
            pass

    # -- proposing --------------------------------------------------------------------
    async def _send_proposal(self, peer: str, timeout_s: float) -> None:
        self._outcome.proposals += 1
        self.stats.proposals_sent += 1
        round_no = self.state.outer_round
        request = encode_frame({"kind": "propose", "spec": self.spec_hash, "round": round_no})
        self.seekers.tried(peer)
        sent = now()
        deadline = sent + timeout_s
        try:
            await self._propose_until_answered(peer, request, deadline)
        except PeerTimeout:
            # its yes may come after we stopped listening (it waits for its own round to
            # open first): unless told, it would hold its round for our payload
            await self._withdraw(peer, round_no)
            raise
        finally:
            self.stats.proposal_s += now() - sent

    async def withdraw_abandoned(self) -> None:
        """Before the node goes: a proposal or payload of ours that stopping cut short
        may have left a peer reserved for us; tell it."""
        peer = self.pairing.abandoned
        if peer is not None:
            self.pairing.abandoned = None
            await self._withdraw(peer, self.state.outer_round)

    async def _withdraw(self, peer: str, round_no: int) -> None:
        request = encode_frame({"kind": "withdraw", "spec": self.spec_hash, "round": round_no})
        try:
            await self.transport.request(peer, protocols.PAIR, request, timeout_s=WITHDRAW_TIMEOUT_S,
                                         max_response_bytes=CONTROL_MAX_BYTES)
        except PeerError:
            pass  # the reservation lapses on its own

    async def _propose_until_answered(self, peer: str, request: bytes, deadline: float) -> None:
        while True:
            try:
                raw = await self.transport.request(peer, protocols.PAIR, request, timeout_s=deadline - now(),
                                                   max_response_bytes=CONTROL_MAX_BYTES)
                self.guard.succeeded(peer)
                break
            except StreamClosed:
                # About one call in a thousand loses its answer to a reset inside the
                # daemons, between healthy peers: ask again at once (a proposal is
                # idempotent: a peer that reserved itself for us says yes again).
                # The second in a row is a failure, and bans.
                if self.guard.stream_closed(peer) or deadline - now() <= 0:
                    raise
        yes, why = answer_is_yes(raw)
        if not yes:
            self.stats.proposals_refused += 1
            self.stats.proposals_refused_busy += why == "busy"
            self.stats.proposals_refused_not_ready += why == "not-ready"
            try:
                hints, ready_in_s = refusal_hints(raw), refusal_ready_in_s(raw)
            except ProtocolError as exc:
                self.guard.fault(peer, f"bad refusal of a proposal ({exc})")
                raise
            self.seekers.hinted([hint for hint in hints if hint != self.own_id])
            raise Refused(why, ready_in_s)
        self._outcome.partner_at = now()

    # -- answering proposals ------------------------------------------------------------
    async def handle_propose(self, remote: str, request: bytes) -> bytes:
        """A peer of our stage asks to pair this round: a few bytes, so a refusal is cheap."""
        try:
            kind, round_no = check_pair_request(request, self.spec_hash)
            self.pairing.admit_proposal()  # or Refused: a group (DiLoCo) exchanges with everyone, unasked
            if kind == "withdraw":  # a peer can only take back its own proposal: nothing to check
                self._note_withdrawn(remote, round_no)
                return encode_frame({"kind": "withdraw", "ok": True})
            # it failed us or sent a poisoned update: we do not pair with it either
            if self.guard.is_banned(remote):
                raise Refused("busy")
            try:
                if self.pairing.state.value == "idle" and not self._took_back(remote, round_no):
                    await self.maybe_round_early(wait_s=PROPOSE_TIMEOUT_S / 2, for_peer=remote)
                if self._took_back(remote, round_no):  # maybe while we opened our round for it
                    raise Refused("withdrawn")
                self.pairing.on_propose(remote)
            except Refused as exc:
                hints = self.seekers.hints_for(remote)
                self.seekers.proposed(remote)  # it seeks: our lead when our own proposal is refused
                return refusal(str(exc), hints, self._ready_in_s() if str(exc) == "not-ready" else None)
            finally:
                self.pairing.drop_hold(remote)  # answered (a yes confirmed it) or cut short
            self.seekers.tried(remote)
            self._outcome.partner_at = now()
            return encode_frame({"kind": "propose", "ok": True})
        except Refused as exc:
            return encode_frame({"ok": False, "error": str(exc)})
        except ProtocolError as exc:
            self.guard.fault(remote, f"bad pairing proposal ({exc})")
            return encode_frame({"ok": False, "error": "protocol"})

    def _took_back(self, remote: str, round_no: int | None) -> bool:
        return remote in self._withdrawn and self._withdrawn[remote] == round_no

    def _note_withdrawn(self, remote: str, round_no: int | None) -> None:
        self._withdrawn.pop(remote, None)
        self._withdrawn[remote] = round_no
        if len(self._withdrawn) > MAX_WITHDRAWN_TRACKED:
            self._withdrawn.pop(next(iter(self._withdrawn)))
        self.pairing.withdrawn(remote)

    def _ready_in_s(self) -> float | None:
        """When our round will be past half (we then accept a proposal, rule 7), at this
        round's pace so far; None when we cannot tell."""
        if self.gate.in_round or self._round_opened_at is None:
            return None
        fraction, elapsed = self.state.round_fraction(), now() - self._round_opened_at
        if not 0.0 < fraction < 0.5 or elapsed <= 0:
            return None
        ready_in_s = elapsed * (0.5 - fraction) / fraction
        return ready_in_s if ready_in_s <= READY_IN_WORTH_SAYING_S else None

"""The outer round: find a partner (NoLoCo) or gather the stage (DiLoCo), swap (phi,
Delta) with it, check what came, and apply the outer step.

Seeking side: when a round is due the node encodes its payload once, announces
``seeking`` in its record (a one-key registry's; a sharded one's heartbeats say it), and lets the coordinator (gossip/pairing.py, or
gossip/group.py for DiLoCo) propose and exchange until the round deadline. An exchange
moves both payloads at once: the caller sends its own (``/swarm-node/outer``, answered
with the partner's verdict) while it fetches the partner's (``/swarm-node/outer-fetch``);
both are paced bodies (net/pacing.py), so proposals, heartbeats and forwards keep
their deadlines beside them. Answering side: proposals, payloads and fetches are served
here; a partner's payload passes gossip/partner_check.py before it counts. A peer at
its boundary can pull our round forward when we are past half of ours, so that nodes
whose boundaries alternate still meet.

A partner that fails or sends a poisoned update is banned (net/guard.py) and the round
goes on without it; a round that finds nobody takes the local-only step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swarm_node.errors import PeerRefused, ProtocolError, StreamClosed
from swarm_node.gossip.group import GroupRound
from swarm_node.gossip.pairing import HINTED, SEEKING_NOW, PairingCoordinator, PairResult, Refused, now
from swarm_node.gossip.partner_check import ROUNDS_APART, PartnerCheck, Poisoned, RoundsApart
from swarm_node.gossip.seekers import Seekers
from swarm_node.net import protocols
from swarm_node.net.transport import ServeLimits, short_id
from swarm_node.node_services import NodeServices
from swarm_node.train.rounds import RoundGate, force_round_if_ready
from swarm_node.train.worker import OpenRound
from swarm_node.wire.codec import FrameLimits, decode_frame, encode_frame, peek_header
from swarm_node.wire.messages import (
    CONTROL_MAX_BYTES,
    OUTER_PARTS,
    answer_is_yes,
    check_fetch,
    check_outer_header,
    check_proposal,
    outer_part,
    refusal,
    refusal_hints,
    refusal_ready_in_s,
)
from swarm_node.wire.outer_codec import OuterCodec, part_tensors

log = logging.getLogger(__name__)

READY_IN_WORTH_SAYING_S = 30.0  # further off than a round's deadline, a "ready in" is of no use to the proposer
DECLINES_BEFORE_BACKOFF = 3  # rounds-apart declines of one peer in a row
MAX_DECLINED_TRACKED = 4096
PROPOSE_TIMEOUT_S = 5.0  # a pairing proposal is a few bytes: no answer in this time means the peer is unwell
PARTS_A_PEER = 2  # concurrent outer and outer-fetch streams a peer may hold (serve: the two parts)
VERDICT_YES = encode_frame({"kind": "outer", "ok": True})
Tensors = list[torch.Tensor]


class OuterState(Protocol):
    """What the exchange needs of a stage (train/worker.py's StageWorker has it all)."""

    outer_round: int
    params: Sequence[torch.Tensor]

    codec: OuterCodec

    def open_round(self, overlapped: bool) -> OpenRound: ...

    def own_payload(self) -> tuple[Tensors, Tensors]: ...

    def decode_payload(self, wire: Tensors, device: torch.device) -> tuple[Tensors, Tensors]: ...

    def decode_part(self, tensors: Tensors, part: str, device: torch.device) -> Tensors: ...

    def land_partner_delta(self, round_no: int, delta: Tensors) -> bool: ...

    def close_round(self, others: list[tuple[Tensors, Tensors]]) -> None: ...

    def own_phi(self) -> Sequence[torch.Tensor]: ...

    def own_delta(self) -> Sequence[torch.Tensor]: ...

    def outer_round_due(self) -> bool: ...

    def round_fraction(self) -> float: ...

    def can_round_early(self) -> bool: ...

    def force_round(self) -> None: ...


@dataclass(frozen=True)
class ExchangeTimes:
    round_timeout_s: float  # how long to seek a partner before the local-only step
    exchange_s: float  # one payload exchange, both ways
    overlapped: bool = True  # inner steps go on while the exchange runs (ALGORITHM.md section 3.1)
    both_at_once: bool = True  # our payload goes out while the partner's comes in (False: one after the other)


@dataclass(frozen=True)
class PayloadParts:
    """A pair's payload as it moves: Delta ahead of phi, each its own frame, so the
    partner's Delta moves our inner steps as soon as it is in (ALGORITHM.md 3.1)."""
    delta: bytes
    phi: bytes

    def part(self, name: str | None) -> bytes:
        if name not in OUTER_PARTS:
            raise ProtocolError("a pair's payload is fetched a part at a time")
        return self.delta if name == "delta" else self.phi


Payload = bytes | PayloadParts


@dataclass
class RoundOutcome:
    """One round and its critical path: preparing the payload, finding a partner, the
    payloads moving, the outer step (times on the loop's clock: time.monotonic on a
    real loop)."""
    round_no: int
    started_at: float = 0.0
    partners: list[str] = field(default_factory=list)
    seconds: float = 0.0  # from the boundary to the outer step applied
    proposals: int = 0  # proposals we sent
    alone: bool = False  # nobody else was in the stage (as our view had it): local-only by plan
    prepare_s: float = 0.0  # snapshot, our own Delta's scale, encoding
    partner_at: float | None = None  # when the partner was agreed (its proposal or ours accepted)
    exchange_s: float | None = None  # from the partner agreed to its payload in and checked
    delta_in_s: float | None = None  # from the partner agreed to its Delta in, checked and landed
    waited_first_s: float = 0.0  # steps held after the boundary for the partner's Delta (waiting first)
    close_s: float = 0.0  # decoding, checks, the outer step
    ended_at: float = 0.0


class OuterExchange:
    def __init__(self, *, spec_hash: str, method: str, times: ExchangeTimes, state: OuterState,
                 services: NodeServices, gate: RoundGate, candidates: Callable[[], list[tuple[str, int]]],
                 callers_expected: Callable[[], bool], announce: Callable[[], Awaitable[None]],
                 stopping: asyncio.Event, own_id: str, max_update_ratio: float = 3.0,
                 gate_holds_steps: bool = True):
        self.spec_hash = spec_hash
        self.times = times
        self.state = state
        self.compute, self.transport, self.guard, self.stats = (services.compute, services.transport,
                                                                services.guard, services.stats)
        self.gate = gate
        # whether the gate holds this node's own steps: stage 0, which draws the micro-batches
        # (or a one-stage node); a later stage computes what its upstream sends, gate or not
        self.gate_holds_steps = gate_holds_steps
        self.candidates = candidates  # callable, unbanned peers of our stage: (peer, how likely it accepts now)
        self.callers_expected = callers_expected  # peers that cannot be called may call us this round
        self.announce = announce  # publish our record now (it says whether we seek)
        self.stopping = stopping
        self.check = PartnerCheck(max_update_ratio)
        numel = sum(p.numel() for p in state.params)
        self.shapes = [p.shape for p in state.params]
        # phi and Delta in fp32 at most (an fp16 tensor out of range goes as fp32); blockwise, two tensors each
        self.limits = FrameLimits(max_payload_bytes=2 * numel * 4 + (1 << 20), max_tensors=4 * len(self.shapes) + 16)
        self.pairing: PairingCoordinator | GroupRound
        if method == "diloco":  # every live peer of the stage
            self.pairing = GroupRound(round_timeout_s=times.round_timeout_s, request_timeout_s=times.exchange_s)
        else:  # NoLoCo: one random partner
            self.pairing = PairingCoordinator(round_timeout_s=times.round_timeout_s,
                                              request_timeout_s=times.exchange_s,
                                              propose_timeout_s=PROPOSE_TIMEOUT_S, own_id=own_id)
        self.own_id = own_id
        self.seekers = Seekers(now)  # peers heard seeking lately: whom we try first, and name in refusals
        self.last: RoundOutcome | None = None
        self.behind = False  # a partner rounds ahead was out of our scale: the node should catch up
        self._outcome = RoundOutcome(-1)
        self._declined: dict[str, int] = {}  # peer -> rounds-apart declines in a row
        self._alone = False  # the last round found nobody else in the stage
        self._offer: Payload | None = None  # our payload while a round is open
        self._round_opened_at: float | None = None
        # after a round, our payload stays for its partners (on the loop's clock) until the
        # exchange time is up: a partner's fetch may come after its payload has paired us
        self._kept: dict[str, tuple[Payload, float]] = {}
        # a partner's Delta sent ahead of its phi, checked, until the phi comes: (peer, our round, Delta)
        self._partner_delta: tuple[str, int, Tensors] | None = None
        # (caller, the round it claimed) of the last payload that made a pair here: a repeat
        # of it, sent again after a reset lost our answer, is answered yes and not taken twice
        self._last_taken: tuple[str, Any] | None = None
        # the last paired exchange: how long it took from its round's open, and when that
        # round's steps began (the next boundary ends them): what the next round may wait first
        self._last_exchange_s: float | None = None
        self._steps_began_at: float | None = None
        self._delta_in = asyncio.Event()  # the open round's partner Delta has landed

    @property
    def seeking(self) -> bool:
        return self.pairing.state.value in ("seeking", "proposing")

    async def serve(self, transport, authorize: Callable[[str], bool]) -> None:
        # A pair's payload moves as two parts, one call after the other on each protocol.
        # A paced call holds its slot until the last acknowledgement is read, which the
        # caller sends just before its next call: with one slot a peer, the second part
        # was at times told "busy" on a loaded machine, and the pair was lost (the caller's
        # partner failed; the callee had paired). Two slots a peer let the parts overlap.
        await transport.serve(protocols.OUTER, self.handle_outer,
                              ServeLimits(max_request_bytes=self.limits.max_payload_bytes, max_concurrent=4,
                                          max_per_peer=PARTS_A_PEER, handler_timeout_s=self.times.exchange_s,
                                          paced_request=True),
                              authorize=authorize)
        await transport.serve(protocols.OUTER_FETCH, self.handle_fetch,
                              ServeLimits(max_request_bytes=CONTROL_MAX_BYTES, max_concurrent=4,
                                          max_per_peer=PARTS_A_PEER, handler_timeout_s=self.times.exchange_s,
                                          paced_response=True),
                              authorize=authorize)
        await transport.serve(protocols.PAIR, self.handle_propose,
                              ServeLimits(max_request_bytes=CONTROL_MAX_BYTES, max_concurrent=8, max_per_peer=1,
                                          handler_timeout_s=PROPOSE_TIMEOUT_S),
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
        await self.compute(self._note_own_delta, opened.fraction)
        reply = await self.compute(self._encode_payload, round_no, opened.wire)
        outcome.prepare_s = now() - started
        callers = self.callers_expected()
        had_company = callers or bool(self.candidates())
        outcome.alone = not had_company
        announcing = asyncio.create_task(self._announce_seeking())
        resuming = (asyncio.create_task(self._resume_steps(opened_at + wait_first_s, outcome))
                    if wait_first_s > 0 else None)
        self._offer = reply
        try:
            others = await self._gather(round_no, reply, expect_request=self.gate.requested or callers)
        finally:
            # the round may end before the record is out (the caller publishes after) or
            # before the Delta came (the steps go on now)
            helpers = [task for task in (announcing, resuming) if task is not None]
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            self._offer = None
            self._partner_delta = None  # a Delta whose phi never came: the round is over
        self._last_exchange_s = now() - opened_at if others else None  # steps could have begun at the open
        self._kept = {peer: (reply, now() + self.times.exchange_s) for peer, _ in others}
        closing = now()
        if others and outcome.partner_at is not None:
            outcome.exchange_s = closing - outcome.partner_at
        await self.compute(self.state.close_round, [payload for _, payload in others])
        outcome.partners = [peer for peer, _ in others]
        outcome.ended_at = now()
        outcome.close_s = outcome.ended_at - closing
        outcome.seconds = outcome.ended_at - started
        self._count(outcome, had_company)
        self.last = outcome
        return outcome

    def _wait_first_s(self) -> float:
        """How long the steps may wait for the partner's Delta before they start. An
        exchange that outlasted its round's steps last time will likely do so again, and
        the steps then stand at the next boundary anyway: spent first, the wait lets every
        step of the round start from the pair's Delta step (ALGORITHM.md 3.1) at no cost
        in time. Capped by how far the last exchange outlasted the steps it would have
        had without a wait (its time from the open against the steps' time to this
        boundary), so a fast link waits not at all, a partner that never sends its Delta
        costs no more than the boundary would, and the cap follows the link both ways:
        a wait spent first is not counted again as one the next round needs."""
        if not self.gate_holds_steps or not isinstance(self.pairing, PairingCoordinator):
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

    def _encode_payload(self, round_no: int, wire: Tensors) -> Payload:
        """On the compute thread: our payload's frames. A pair's goes as two parts, Delta
        first; a DiLoCo group's whole (a member needs every other's Delta before any
        moves its steps)."""
        header = {"kind": "outer", "spec": self.spec_hash, "round": round_no, "ok": True}
        if not isinstance(self.pairing, PairingCoordinator):
            return encode_frame(header, wire)
        n_phi = part_tensors(self.state.codec, "phi", len(self.state.params))
        return PayloadParts(delta=encode_frame({**header, "part": "delta"}, wire[n_phi:]),
                            phi=encode_frame({**header, "part": "phi"}, wire[:n_phi]))

    def _note_own_delta(self, fraction: float) -> None:
        """On the compute thread: our Delta as sent is the scale partners are held to."""
        self.check.note_own_delta(self.state.own_payload()[1], fraction)

    async def _gather(self, round_no: int, reply: Payload, expect_request: bool) -> list[tuple[str, Any]]:
        if isinstance(self.pairing, GroupRound):
            gathered = await self.pairing.run_round(
                round_no, reply, members=lambda: [peer for peer, _ in self.candidates()], send=self._send_outer,
                on_peer_failure=self._partner_failed, expect_request=expect_request)
            return list(gathered.items())
        result: PairResult | None = await self.pairing.run_round(
            round_no, reply, candidates=self._pairing_candidates, propose=self._send_proposal, send=self._send_outer,
            on_peer_failure=self._partner_failed, expect_request=expect_request)
        return [(result.partner, result.payload)] if result else []

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

    def _count(self, outcome: RoundOutcome, had_company: bool) -> None:
        alone_before, self._alone = self._alone, not had_company
        self.stats.note_round(outcome.seconds, outcome.prepare_s, outcome.close_s,
                              to_partner_s=outcome.partner_at - outcome.started_at
                              if outcome.partners and outcome.partner_at is not None else None,
                              exchange_s=outcome.exchange_s)
        self.stats.round_waited_first_s += outcome.waited_first_s
        if not outcome.partners:
            self.stats.local_only_rounds += 1
            if had_company:  # alone in the stage, a local-only round is the plan, not a failure
                self.stats.note_failure(f"round {outcome.round_no}: no partner, local-only step")
                log.info("round %d: no partner found in %.1fs, local-only step", outcome.round_no, outcome.seconds)
            else:
                self.stats.rounds_alone += 1
                if not alone_before:  # once, not every round (a few a second with a small H)
                    log.info("round %d: no other peer in our stage; local-only steps until one joins",
                             outcome.round_no)
        else:
            self.stats.rounds_with_partner += 1
            self.stats.partners.extend(outcome.partners)
            log.info("round %d: averaged with %s in %.2fs", outcome.round_no,
                     ", ".join(short_id(p) for p in outcome.partners), outcome.seconds)

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
        if (isinstance(self.pairing, PairingCoordinator) and self.pairing.state.value == "idle"
                and any(likely >= SEEKING_NOW for _, likely in self.candidates())):
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
        if for_peer is not None and isinstance(self.pairing, PairingCoordinator):
            self.pairing.hold_for(for_peer)  # handle_propose drops it once it has answered
        self.gate.open_early()
        try:
            async with asyncio.timeout(wait_s):
                await self.pairing.seeking.wait()
        except TimeoutError:
            pass

    async def _send_proposal(self, peer: str, timeout_s: float) -> None:
        self._outcome.proposals += 1
        self.stats.proposals_sent += 1
        request = encode_frame({"kind": "propose", "spec": self.spec_hash, "round": self.state.outer_round})
        self.seekers.tried(peer)
        sent = now()
        deadline = sent + timeout_s
        try:
            await self._propose_until_answered(peer, request, deadline)
        finally:
            self.stats.proposal_s += now() - sent

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

    async def _send_outer(self, peer: str, payload: Payload, timeout_s: float) -> tuple[Tensors, Tensors]:
        """Our payload to ``peer`` and its payload to us, both at once; returns its payload,
        checked, once it has taken ours. A pair's payloads move Delta first, and the
        partner's Delta lands as soon as it is in."""
        deadline = now() + timeout_s
        sending = asyncio.create_task(self._send_payload(peer, payload, deadline))
        if not self.times.both_at_once:  # for comparison: the partner's payload only after ours is in
            await asyncio.wait([sending])
        fetching = asyncio.create_task(self._fetch_payload(peer, isinstance(payload, PayloadParts), deadline))
        try:
            _, checked = await asyncio.gather(sending, fetching)
        except BaseException:
            for task in (sending, fetching):
                task.cancel()
            await asyncio.gather(sending, fetching, return_exceptions=True)
            raise
        return checked

    async def _send_payload(self, peer: str, payload: Payload, deadline: float) -> None:
        for frame in (payload.delta, payload.phi) if isinstance(payload, PayloadParts) else (payload,):
            verdict = await self._asked_again_once(peer, lambda: self.transport.request(
                peer, protocols.OUTER, frame, timeout_s=deadline - now(), max_response_bytes=CONTROL_MAX_BYTES,
                paced_request=True), deadline)
            yes, why = answer_is_yes(verdict)  # a few bytes: no need to wait for the compute thread
            if not yes:
                raise Refused(why)

    async def _asked_again_once(self, peer: str, ask: Callable[[], Awaitable[bytes]], deadline: float) -> bytes:
        """A payload part or fetch whose answer a stream reset lost (about one call in a
        thousand between healthy peers, see _propose_until_answered) is asked again: a
        partner that took our phi says yes again, and a fetch is served again. Without
        this the partner pairs and we do not. The second reset in a row is a failure."""
        while True:
            try:
                answer = await ask()
                self.guard.succeeded(peer)
                return answer
            except StreamClosed:
                if self.guard.stream_closed(peer) or deadline - now() <= 0:
                    raise

    async def _fetch_payload(self, peer: str, in_parts: bool, deadline: float) -> tuple[Tensors, Tensors]:
        if not in_parts:
            return await self._fetch(peer, deadline)
        delta = await self._fetch(peer, deadline, "delta")
        if self._outcome is not None and self._outcome.partner_at is not None:
            self._outcome.delta_in_s = now() - self._outcome.partner_at
        return await self._fetch(peer, deadline, "phi"), delta

    async def _fetch(self, peer: str, deadline: float, part: str | None = None):
        """The partner's payload, or one ``part`` of it, checked (a Delta also landed)."""
        request = encode_frame({"kind": "outer-fetch", "spec": self.spec_hash, "round": self.state.outer_round,
                                **({} if part is None else {"part": part})})
        raw = await self._asked_again_once(peer, lambda: self.transport.request(
            peer, protocols.OUTER_FETCH, request, timeout_s=deadline - now(),
            max_response_bytes=self.limits.max_payload_bytes + (1 << 16), paced_response=True), deadline)
        header, tensors = await self.compute(decode_frame, raw, self.limits)
        if not header.get("ok"):
            raise Refused(str(header.get("error", "refused"))[:200])
        return await self._check_partner(peer, header, tensors, part)

    async def _check_partner(self, peer: str, header: dict, tensors: Tensors, part: str | None = None):
        """The partner's payload (``part`` None) or one part of it, decoded and held to our
        scale; a Delta that passes moves our steps at once."""
        check_outer_header(header, self.spec_hash, part)
        theirs, ours = header.get("round"), self.state.outer_round
        rounds_ahead = theirs - ours if type(theirs) is int else 0  # a claim: it only picks how we refuse
        try:
            checked = await self.compute(self._decode_and_check, tensors, rounds_ahead, part)
            self._declined.pop(peer, None)
            if part == "delta":
                self._delta_in.set()  # landed: steps held for it may start
            return checked
        except Poisoned as exc:
            self.guard.poisoned(peer, str(exc))
            raise
        except RoundsApart as exc:
            if exc.rounds_ahead >= ROUNDS_APART:
                self.behind = True
            # Honest peers rounds apart meet in scale again within a round or two (the one
            # behind catches up); a peer declined again and again, as one claiming another
            # round to dodge the poison check would be, is backed off (not banned for
            # long: it stays a donor) so that it cannot take our rounds.
            declines = self._declined.pop(peer, 0) + 1
            self._declined[peer] = declines
            if len(self._declined) > MAX_DECLINED_TRACKED:
                self._declined.pop(next(iter(self._declined)))
            if declines >= DECLINES_BEFORE_BACKOFF:
                self.guard.failed(peer)
            self.guard.note(peer, f"declining an outer exchange with {short_id(peer)} at round {theirs} (we are at "
                                  f"{ours}): {exc}")
            raise
        except Refused as exc:
            log.info("declining an outer exchange before our first round: %s", exc)
            raise

    def _decode_and_check(self, tensors: Tensors, rounds_ahead: int, part: str | None = None):
        """On the compute thread: the partner's payload (or ``part`` of it) in the run's
        codec, then held to our scale. A Delta ahead of its phi lands here, on the round
        it was sent for."""
        cpu = torch.device("cpu")
        if part is None:
            phi, delta = self.state.decode_payload(tensors, cpu)
            return self.check.check(phi + delta, self.state.own_phi(), self.state.own_delta, rounds_ahead)
        values = self.state.decode_part(tensors, part, cpu)
        if part == "phi":
            return self.check.check_phi(values, self.state.own_phi(), self.state.own_delta, rounds_ahead)
        delta = self.check.check_delta(values, self.state.own_phi(), self.state.own_delta, rounds_ahead)
        self.state.land_partner_delta(self.state.outer_round, delta)
        return delta

    # -- the answering side ------------------------------------------------------------
    async def handle_propose(self, remote: str, request: bytes) -> bytes:
        """A peer of our stage asks to pair this round: a few bytes, so a refusal is cheap."""
        try:
            check_proposal(request, self.spec_hash)
            if not isinstance(self.pairing, PairingCoordinator):
                raise Refused("not-pairing")  # a DiLoCo run exchanges with everyone, no proposals
            if self.guard.is_banned(remote):  # it failed us or sent a poisoned update: we do not pair with it either
                raise Refused("busy")
            try:
                if self.pairing.state.value == "idle":  # else: not-ready, not a time-out
                    await self.maybe_round_early(wait_s=PROPOSE_TIMEOUT_S / 2, for_peer=remote)
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

    async def handle_outer(self, remote: str, request: bytes) -> bytes:
        """A partner's payload, or a pair's part of one (its Delta, then its phi); the
        answer is our verdict (our payload goes on ``handle_fetch``)."""
        async def partner_payload():
            header, tensors = await self.compute(decode_frame, request, self.limits)
            return await self._check_partner(remote, header, tensors)

        async def partner_phi():
            header, tensors = await self.compute(decode_frame, request, self.limits)
            phi = await self._check_partner(remote, header, tensors, "phi")
            kept, self._partner_delta = self._partner_delta, None
            if kept is None or kept[:2] != (remote, self.state.outer_round):
                raise ProtocolError("sent its phi without its Delta")
            return phi, kept[2]

        pairing = self.pairing
        try:
            if isinstance(pairing, PairingCoordinator):  # only the peer whose proposal we accepted gets in
                try:
                    header = peek_header(request, self.limits)
                    part, taken = outer_part(header), (remote, header.get("round"))
                except ProtocolError:
                    part = taken = None  # the whole payload's path refuses it: unread if unreserved, else a fault
                if part == "phi" and taken == self._last_taken:
                    return VERDICT_YES  # asked again after a reset lost our answer: it is taken
                if part == "delta":
                    if not pairing.may_fetch(remote):
                        raise Refused("no-reservation")
                    header, tensors = await self.compute(decode_frame, request, self.limits)
                    delta = await self._check_partner(remote, header, tensors, "delta")
                    self._partner_delta = (remote, self.state.outer_round, delta)
                    return VERDICT_YES
                # a pair's phi completes its Delta; a whole payload (a peer that sends it so) also pairs
                await pairing.answer(remote, partner_phi if part == "phi" else partner_payload)
                self._last_taken = taken
                return VERDICT_YES
            payload = await partner_payload()
            if pairing.state.value == "idle":
                await self.maybe_round_early(wait_s=5.0)
            pairing.on_request(remote, payload)
            return VERDICT_YES
        except (Refused, PeerRefused) as exc:
            return encode_frame({"ok": False, "error": str(exc)})
        except ProtocolError as exc:
            self.guard.fault(remote, f"bad outer exchange ({exc})")
            self.guard.failed(remote)
            return encode_frame({"ok": False, "error": "protocol"})

    async def handle_fetch(self, remote: str, request: bytes) -> bytes:
        """Our payload (a pair's, a part at a time), for the peer we pair with (or, in
        DiLoCo, any member) this round."""
        try:
            part = check_fetch(request, self.spec_hash)
            if self._offer is not None and self.pairing.may_fetch(remote):
                return _payload_part(self._offer, part)
            kept, until = self._kept.get(remote, (None, 0.0))
            if kept is not None and now() < until:
                return _payload_part(kept, part)
            return encode_frame({"ok": False, "error": "not-ready" if self._offer is None else "no-reservation"})
        except ProtocolError as exc:
            self.guard.fault(remote, f"bad outer fetch ({exc})")
            return encode_frame({"ok": False, "error": "protocol"})


def _payload_part(payload: Payload, part: str | None) -> bytes:
    if isinstance(payload, PayloadParts):
        return payload.part(part)
    if part is not None:
        raise ProtocolError("a group's payload is fetched whole")
    return payload


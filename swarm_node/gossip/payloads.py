"""A round's payload, (phi, Delta), both ways between partners (``/swarm-node/outer`` and
``/swarm-node/outer-fetch``), and what comes checked before it counts.

What it owns: our payload's frames (a pair's go as two parts, Delta ahead of phi; a DiLoCo
group's whole), offered while our round is open and kept a while after it for the partners
whose fetch comes late; the caller side, which sends ours (answered with the partner's
verdict) while it fetches the partner's, both paced bodies (net/pacing.py) so proposals,
heartbeats and forwards keep their deadlines beside them; the answering side, which hands
a partner's payload to the round's pairing (gossip/round_pairing.py: a pair's only from
the peer we reserved, a group's from any member) and answers its verdict; and the checks
of gossip/partner_check.py on all that comes, a Delta landed on our steps the moment it
passes (ALGORITHM.md 3.1). A partner that sends a poisoned update is banned
(net/guard.py); one rounds apart is declined, and backed off if it keeps coming.

Who the partner is and when a round opens and ends is gossip/exchange.py's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from swarm_node.errors import PeerRefused, ProtocolError, StreamClosed
from swarm_node.gossip.pairing import Refused, now
from swarm_node.gossip.partner_check import ROUNDS_APART, PartnerCheck, Poisoned, RoundsApart, StepSchedule
from swarm_node.gossip.round_pairing import RoundPairing
from swarm_node.net import protocols
from swarm_node.net.transport import ServeLimits, short_id
from swarm_node.node_services import NodeServices
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame
from swarm_node.wire.messages import (
    CONTROL_MAX_BYTES,
    OUTER_PARTS,
    answer_is_yes,
    check_fetch,
    check_outer_header,
    outer_steps,
)
from swarm_node.wire.outer_codec import OuterCodec, part_tensors

log = logging.getLogger(__name__)

DECLINES_BEFORE_BACKOFF = 3  # rounds-apart declines of one peer in a row
MAX_DECLINED_TRACKED = 4096
PARTS_A_PEER = 2  # concurrent outer and outer-fetch streams a peer may hold (serve: the two parts)
SERVED_AT_ONCE = 4  # outer (and outer-fetch) streams served at once, from all peers
VERDICT_YES = encode_frame({"kind": "outer", "ok": True})
Tensors = list[torch.Tensor]


class PayloadState(StepSchedule, Protocol):
    """What the payloads need of a stage (train/worker.py's StageWorker has it all)."""

    outer_round: int
    params: Sequence[torch.Tensor]

    codec: OuterCodec

    def own_payload(self) -> tuple[Tensors, Tensors]: ...

    def decode_payload(self, wire: Tensors, device: torch.device) -> tuple[Tensors, Tensors]: ...

    def decode_part(self, tensors: Tensors, part: str, device: torch.device) -> Tensors: ...

    def land_partner_delta(self, round_no: int, delta: Tensors) -> bool: ...

    def own_phi(self) -> Sequence[torch.Tensor]: ...

    def own_delta(self) -> Sequence[torch.Tensor]: ...


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


class PayloadSwap:
    def __init__(self, *, spec_hash: str, state: PayloadState, services: NodeServices,
                 pairing: RoundPairing, check: PartnerCheck, exchange_s: float,
                 both_at_once: bool, round_early: Callable[[float], Awaitable[None]],
                 on_delta: Callable[[bool], None], serve_s: float | None = None):
        self.spec_hash = spec_hash
        self.state = state
        self.compute, self.transport, self.guard = services.compute, services.transport, services.guard
        self.pairing = pairing  # its rule says whose payload we take, and how, and who may fetch ours
        self.check = check
        self.exchange_s = exchange_s  # one payload exchange, both ways (a group member's: beside the others)
        # what a served payload may take: the longest a round's measured link may stretch exchange_s to
        # (a caller that stalls is cut sooner, net/stalls.py)
        self.serve_s = exchange_s if serve_s is None else max(exchange_s, serve_s)
        # False: the partner's payload only after ours is in (for comparison)
        self.both_at_once = both_at_once
        self.round_early = round_early  # (wait_s) a group member's payload may pull our round forward
        self.on_delta = on_delta  # a partner's Delta is in, checked and landed (True: one we fetched)
        numel = sum(p.numel() for p in state.params)
        # phi and Delta in fp32 at most (an fp16 tensor out of range goes as fp32);
        # blockwise, two tensors each
        self.limits = FrameLimits(max_payload_bytes=2 * numel * 4 + (1 << 20),
                                  max_tensors=4 * len(state.params) + 16)
        self.behind = False  # a partner rounds ahead was out of our scale: the node should catch up
        self.offer: Payload | None = None  # our payload while a round is open
        # after a round, our payload stays for its partners (on the loop's clock) until the
        # exchange time is up: a partner's fetch may come after its payload has paired us
        self._kept: dict[str, tuple[Payload, float]] = {}
        self._declined: dict[str, int] = {}  # peer -> rounds-apart declines in a row

    async def serve(self, transport, authorize: Callable[[str], bool]) -> None:
        # A pair's payload moves as two parts, one call after the other on each protocol.
        # A paced call holds its slot until the last acknowledgement is read, which the
        # caller sends just before its next call: with one slot a peer, the second part
        # was at times told "busy" on a loaded machine, and the pair was lost (the caller's
        # partner failed; the callee had paired). Two slots a peer let the parts overlap.
        await transport.serve(protocols.OUTER, self.handle_outer,
                              ServeLimits(max_request_bytes=self.limits.max_payload_bytes,
                                          max_concurrent=SERVED_AT_ONCE, max_per_peer=PARTS_A_PEER,
                                          handler_timeout_s=self.serve_s, paced_request=True),
                              authorize=authorize)
        await transport.serve(protocols.OUTER_FETCH, self.handle_fetch,
                              ServeLimits(max_request_bytes=CONTROL_MAX_BYTES, max_concurrent=SERVED_AT_ONCE,
                                          max_per_peer=PARTS_A_PEER, handler_timeout_s=self.serve_s,
                                          paced_response=True),
                              authorize=authorize)

    # -- our own payload ---------------------------------------------------------------
    def encode(self, round_no: int, wire: Tensors, steps: tuple[int, int] | None = None) -> Payload:
        """On the compute thread: our payload's frames, saying the inner ``steps`` its
        Delta covers (partners hold it to their scale for those steps). A pair's goes as
        two parts, Delta first; a DiLoCo group's whole (a member needs every other's
        Delta before any moves its steps)."""
        header = {"kind": "outer", "spec": self.spec_hash, "round": round_no, "ok": True,
                  **({} if steps is None else {"steps": list(steps)})}
        if not self.pairing.delta_ahead:
            return encode_frame(header, wire)
        n_phi = part_tensors(self.state.codec, "phi", len(self.state.params))
        return PayloadParts(delta=encode_frame({**header, "part": "delta"}, wire[n_phi:]),
                            phi=encode_frame({**header, "part": "phi"}, wire[:n_phi]))

    def note_own_delta(self, fraction: float, steps: tuple[int, int] | None = None) -> None:
        """On the compute thread: our Delta as sent, over ``steps``, sets the scale partners are held to."""
        self.check.note_own_delta(self.state.own_payload()[1], fraction, steps)

    def withdraw(self) -> None:
        """The round is over: our payload is no longer offered, and a Delta whose phi
        never came is dropped."""
        self.offer = None
        self.pairing.round_over()

    @property
    def outer_round(self) -> int:
        return self.state.outer_round

    def keep_for(self, partners: list[str], payload: Payload) -> None:
        """Our round's partners may still fetch ``payload`` for an exchange's time."""
        self._kept = {peer: (payload, now() + self.exchange_s) for peer in partners}

    # -- the caller side ---------------------------------------------------------------
    async def send(self, peer: str, payload: Payload, timeout_s: float) -> tuple[Tensors, Tensors]:
        """Our payload to ``peer`` and its payload to us, both at once; returns its payload,
        checked, once it has taken ours. A pair's payloads move Delta first, and the
        partner's Delta lands as soon as it is in."""
        deadline = now() + timeout_s
        sending = asyncio.create_task(self._send_payload(peer, payload, deadline))
        if not self.both_at_once:  # for comparison: the partner's payload only after ours is in
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
            verdict = await self._asked_again_once(peer, lambda frame=frame: self.transport.request(
                peer, protocols.OUTER, frame, timeout_s=deadline - now(),
                max_response_bytes=CONTROL_MAX_BYTES,
                paced_request=True), deadline)
            yes, why = answer_is_yes(verdict)  # a few bytes: no need to wait for the compute thread
            if not yes:
                raise Refused(why)

    async def _asked_again_once(self, peer: str, ask: Callable[[], Awaitable[bytes]],
                                deadline: float) -> bytes:
        """A payload part or fetch whose answer a stream reset lost (about one call in a
        thousand between healthy peers, see OuterExchange._propose_until_answered) is
        asked again: a partner that took our phi says yes again, and a fetch is served
        again. Without this the partner pairs and we do not. The second reset in a row is
        a failure."""
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
        self.on_delta(True)
        return await self._fetch(peer, deadline, "phi"), delta

    async def _fetch(self, peer: str, deadline: float, part: str | None = None):
        """The partner's payload, or one ``part`` of it, checked (a Delta also landed)."""
        request = encode_frame({"kind": "outer-fetch", "spec": self.spec_hash,
                                "round": self.state.outer_round,
                                **({} if part is None else {"part": part})})
        raw = await self._asked_again_once(peer, lambda: self.transport.request(
            peer, protocols.OUTER_FETCH, request, timeout_s=deadline - now(),
            max_response_bytes=self.limits.max_payload_bytes + (1 << 16), paced_response=True), deadline)
        header, tensors = await self.compute(decode_frame, raw, self.limits)
        if not header.get("ok"):
            raise Refused(str(header.get("error", "refused"))[:200])
        return await self._check_partner(peer, header, tensors, part)

    # -- the answering side ------------------------------------------------------------
    async def handle_outer(self, remote: str, request: bytes) -> bytes:
        """A partner's payload, or a pair's part of one (its Delta, then its phi), taken
        as the round's pairing takes it; the answer is our verdict (our payload goes on
        ``handle_fetch``)."""
        try:
            await self.pairing.take(remote, request, self)
            return VERDICT_YES
        except (Refused, PeerRefused) as exc:
            return encode_frame({"ok": False, "error": str(exc)})
        except ProtocolError as exc:
            self.guard.fault(remote, f"bad outer exchange ({exc})")
            self.guard.failed(remote, reason=None)  # counted once, as the fault
            return encode_frame({"ok": False, "error": "protocol"})

    async def take(self, remote: str, request: bytes, part: str | None = None):
        """A partner's payload (``part`` None) or one part of it off the wire, checked."""
        header, tensors = await self.compute(decode_frame, request, self.limits)
        return await self._check_partner(remote, header, tensors, part)

    async def handle_fetch(self, remote: str, request: bytes) -> bytes:
        """Our payload (a pair's, a part at a time), for the peer we pair with (or, in
        DiLoCo, any member) this round."""
        try:
            part = check_fetch(request, self.spec_hash)
            if self.offer is not None and self.pairing.may_fetch(remote):
                return _payload_part(self.offer, part)
            kept, until = self._kept.get(remote, (None, 0.0))
            if kept is not None and now() < until:
                return _payload_part(kept, part)
            return encode_frame({"ok": False,
                                 "error": "not-ready" if self.offer is None else "no-reservation"})
        except ProtocolError as exc:
            self.guard.fault(remote, f"bad outer fetch ({exc})")
            return encode_frame({"ok": False, "error": "protocol"})

    # -- what came ---------------------------------------------------------------------
    async def _check_partner(self, peer: str, header: dict, tensors: Tensors, part: str | None = None):
        """The partner's payload (``part`` None) or one part of it, decoded and held to our
        scale; a Delta that passes moves our steps at once."""
        check_outer_header(header, self.spec_hash, part)
        steps = outer_steps(header)  # a claim: it can only make its scale smaller than our own now
        theirs, ours = header.get("round"), self.state.outer_round
        rounds_ahead = theirs - ours if type(theirs) is int else 0  # a claim: it only picks how we refuse
        try:
            checked = await self.compute(self._decode_and_check, tensors, rounds_ahead, part, steps)
            self._declined.pop(peer, None)
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
                self.guard.failed(peer, reason="rounds-apart")
            self.guard.note(peer,
                            f"declining an outer exchange with {short_id(peer)} at round {theirs} (we are at "
                                  f"{ours}): {exc}")
            raise
        except Refused as exc:
            log.info("declining an outer exchange before our first round: %s", exc)
            raise

    def _decode_and_check(self, tensors: Tensors, rounds_ahead: int, part: str | None = None,
                          steps: tuple[int, int] | None = None):
        """On the compute thread: the partner's payload (or ``part`` of it) in the run's
        codec, then held to our scale (for the ``steps`` it says its Delta covers). A
        Delta ahead of its phi lands here, on the round it was sent for."""
        cpu = torch.device("cpu")
        if part is None:
            phi, delta = self.state.decode_payload(tensors, cpu)
            return self.check.check(phi + delta, self.state.own_phi(), self.state.own_delta, rounds_ahead,
                                    steps)
        values = self.state.decode_part(tensors, part, cpu)
        if part == "phi":
            return self.check.check_phi(values, self.state.own_phi(), self.state.own_delta, rounds_ahead)
        delta = self.check.check_delta(values, self.state.own_phi(), self.state.own_delta, rounds_ahead,
                                       steps)
        self.state.land_partner_delta(self.state.outer_round, delta)
        return delta


def _payload_part(payload: Payload, part: str | None) -> bytes:
    if isinstance(payload, PayloadParts):
        return payload.part(part)
    if part is not None:
        raise ProtocolError("a group's payload is fetched whole")
    return payload

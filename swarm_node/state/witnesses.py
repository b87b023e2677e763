"""Witnesses for a downloaded state (protocol ``/swarm-node/state-sketch/1.0.0``).

Every node answers a sketch request with a count sketch of its own state under the
caller's seed (state/sketch.py) and how far apart it found its recent partners; a
joiner asks the other live peers of its stage for theirs, all at once, once the state
it downloaded is in, and state/check.py weighs the votes. A sketch costs the witness one
pass over its state on the compute thread, so it makes two at a time and answers `busy`
beyond (joiners ask a busy witness again), and each caller gets SKETCH_BURST sketches at
once, then one per SKETCH_INTERVAL_S: a joiner needs one per donor it checks, and a
caller asking for more only keeps the witness busy (against a joiner's check, a busy
witness counts as silent, which never helps a state in)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections import OrderedDict
from collections.abc import Callable

import torch

from swarm_node.errors import PeerError, PeerRefused, ProtocolError
from swarm_node.net import protocols
from swarm_node.net.transport import ServeLimits, short_id
from swarm_node.node_services import NodeServices
from swarm_node.state.check import Witness
from swarm_node.state.sketch import SKETCH_BUCKETS, StateSketch, sketch_state
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame
from swarm_node.wire.messages import check_sketch_answer, check_sketch_request

log = logging.getLogger(__name__)

SKETCH_TIMEOUT_S = 30.0  # one pass over a stage's state, on a busy witness
MAX_WITNESSES = 8
BUSY_RETRIES = 4
SKETCHING_AT_ONCE = 2
SKETCH_BURST = 4  # a joiner checks up to 4 donors' states (state/sync.py MAX_DONORS) in a download
SKETCH_INTERVAL_S = 30.0  # then one more a caller per this
MAX_CALLERS = 1024  # callers whose sketch allowance is kept (the oldest forgotten)


class Witnesses:
    """Both sides of the sketch protocol for one stage."""

    def __init__(self, *, worker: StageWorker, services: NodeServices, spec_hash: str,
                 partner_spread: Callable[[], list[float] | None], clock: Callable[[], float] | None = None):
        self.worker = worker
        self.compute, self.transport, self.guard = services.compute, services.transport, services.guard
        self.spec_hash = spec_hash
        self.partner_spread = partner_spread  # gossip/partner_check.py: PartnerCheck.partner_spread
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self._sketching = asyncio.Semaphore(SKETCHING_AT_ONCE)
        self._allowance: OrderedDict[str, tuple[float, float]] = OrderedDict()  # caller -> (sketches, as of)
        # set while this node trains from a state that is not the stage's (it needed one at
        # start and none was adopted): its sketch would be evidence of nothing, and a far
        # state among two witnesses sets the other's bounds (ALGORITHM.md 8); it answers
        # as silent instead
        self.catching_up = False

    async def serve(self, transport, authorize: Callable[[str], bool]) -> None:
        # streams beyond the sketches made at once are answered at once (busy, or over
        # the caller's allowance): callers told so must not hold the slots of those sketched
        await transport.serve(protocols.STATE_SKETCH, self.handle,
                              ServeLimits(max_request_bytes=1024, max_concurrent=4 * SKETCHING_AT_ONCE,
                                          max_per_peer=1, handler_timeout_s=SKETCH_TIMEOUT_S),
                              authorize=authorize)

    # -- witness side ---------------------------------------------------------------
    async def handle(self, remote: str, request: bytes) -> bytes:
        try:
            header, _ = decode_frame(request, FrameLimits(max_payload_bytes=0))
            seed = check_sketch_request(header, self.spec_hash, SKETCH_BUCKETS)
        except ProtocolError as exc:
            self.guard.fault(remote, f"bad sketch request ({exc})")
            return encode_frame({"ok": False, "error": "protocol"})
        if self.worker.slow is None:
            return encode_frame({"ok": False, "error": "no outer state (local method)"})
        if self.catching_up:
            return encode_frame({"ok": False, "error": "catching up: no state of the stage adopted yet"})
        if self._sketching.locked():
            return b""  # busy: the caller asks again after a backoff
        if not self._allowed(remote):
            return encode_frame({"ok": False, "error": "too many sketch requests"})
        async with self._sketching:
            sketch = await self.compute(own_sketch, self.worker, seed)
        spread = self.partner_spread()
        meta = {"ok": True, "inner_step": sketch.inner_step, "outer_round": sketch.outer_round,
                "round_steps": sketch.round_steps}
        tensors = [sketch.rows()] + ([torch.tensor(spread,
                                                   dtype=torch.float32)] if spread is not None else [])
        return encode_frame(meta, tensors)

    def _allowed(self, remote: str) -> bool:
        """Whether ``remote`` may have a sketch now (and, if so, one is counted): SKETCH_BURST
        at once, refilled at one per SKETCH_INTERVAL_S."""
        now = self.clock()
        left, since = self._allowance.pop(remote, (float(SKETCH_BURST), now))
        left = min(float(SKETCH_BURST), left + (now - since) / SKETCH_INTERVAL_S)
        allowed = left >= 1.0
        self._allowance[remote] = (left - allowed, now)
        while len(self._allowance) > MAX_CALLERS:
            self._allowance.popitem(last=False)
        return allowed

    # -- joiner side ------------------------------------------------------------------
    async def gather(self, peers: list[str], seed: int) -> dict[str, Witness]:
        """What each of ``peers`` says of its state under ``seed``; those that fail to
        answer in time, or answer garbage (charged to them), are left out."""
        answers = await asyncio.gather(*(self._ask(peer, seed) for peer in peers))
        return {peer: answer for peer, answer in zip(peers, answers) if answer is not None}

    async def _request(self, peer: str, request: bytes, limit: int) -> bytes:
        """A witness sketches one state at a time and answers ``busy`` meanwhile (joiners
        arriving together): asked again, with a random backoff, within the deadline."""
        async with asyncio.timeout(SKETCH_TIMEOUT_S):
            for attempt in itertools.count():
                try:
                    return await self.transport.request(peer, protocols.STATE_SKETCH, request,
                                                        timeout_s=SKETCH_TIMEOUT_S, max_response_bytes=limit)
                except PeerRefused:
                    if attempt >= BUSY_RETRIES:
                        raise
                    await asyncio.sleep(random.uniform(0.5, 1.5) * 2 ** attempt)
        raise AssertionError("unreachable")

    async def _ask(self, peer: str, seed: int) -> Witness | None:
        num_tensors = len(self.worker.params)
        request = encode_frame({"kind": "sketch", "spec": self.spec_hash, "seed": seed,
                                "buckets": SKETCH_BUCKETS})
        limit = 4 * (3 * num_tensors * SKETCH_BUCKETS + num_tensors) + (1 << 14)
        try:
            raw = await self._request(peer, request, limit)
            meta, tensors = await self.compute(decode_frame, raw, FrameLimits(max_payload_bytes=limit))
            if not meta.get("ok"):
                log.info("%s gave no sketch (%s)", short_id(peer), str(meta.get("error"))[:80])
                return None
            (inner_step, outer_round, round_steps), rows, spread = check_sketch_answer(
                meta, tensors, num_tensors, SKETCH_BUCKETS)
        except ProtocolError as exc:
            self.guard.ignore(peer, f"its sketch is unusable ({exc})")
            self.guard.failed(peer)
            return None
        except (PeerError, TimeoutError) as exc:
            log.info("no sketch from %s (%s)", short_id(peer), exc)
            return None
        self.guard.succeeded(peer)
        sketch = StateSketch(inner_step=inner_step, outer_round=outer_round, round_steps=round_steps,
                             phi=rows[0].float(), momentum=rows[1].float(), progress=rows[2].float())
        return Witness(sketch, spread.float() if spread is not None else None)


@torch.no_grad()
def own_sketch(worker: StageWorker, seed: int) -> StateSketch:
    """The worker's state sketched under ``seed``, on its device, without copying the stage."""
    return sketch_state(worker.params, worker.slow.phi, worker.slow.momentum, inner_step=worker.inner_step,
                        outer_round=worker.outer_round,
                        round_steps=worker.inner_step - worker.last_round_step,
                        seed=seed)

"""Witnesses for a downloaded state (protocol ``/swarm-node/state-sketch/1.0.0``).

Every node answers a sketch request with a count sketch of its own state under the
caller's seed (state/sketch.py) and how far apart it found its recent partners; a
joiner asks the other live peers of its stage for theirs, all at once, once the state
it downloaded is in, and state/check.py weighs the votes. A sketch costs the witness one
pass over its state on the compute thread, so it answers two requests at a time and
`busy` beyond; joiners ask a busy witness again."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Callable

import torch

from swarm_node.errors import PeerError, PeerRefused, ProtocolError
from swarm_node.net import protocols
from swarm_node.net.transport import ServeLimits, short_id
from swarm_node.node.services import NodeServices
from swarm_node.state.check import Witness
from swarm_node.state.sketch import SKETCH_BUCKETS, StateSketch, sketch_state
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame
from swarm_node.wire.messages import check_sketch_answer, check_sketch_request

log = logging.getLogger(__name__)

SKETCH_TIMEOUT_S = 30.0  # one pass over a stage's state, on a busy witness
MAX_WITNESSES = 8
BUSY_RETRIES = 4


class Witnesses:
    """Both sides of the sketch protocol for one stage."""

    def __init__(self, *, worker: StageWorker, services: NodeServices, spec_hash: str,
                 partner_spread: Callable[[], list[float] | None]):
        self.worker = worker
        self.compute, self.transport, self.guard = services.compute, services.transport, services.guard
        self.spec_hash = spec_hash
        self.partner_spread = partner_spread  # gossip/partner_check.py: PartnerCheck.partner_spread

    async def serve(self, transport, authorize: Callable[[str], bool]) -> None:
        await transport.serve(protocols.STATE_SKETCH, self.handle,
                              ServeLimits(max_request_bytes=1024, max_concurrent=2, max_per_peer=1,
                                          handler_timeout_s=SKETCH_TIMEOUT_S),
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
        sketch = await self.compute(own_sketch, self.worker, seed)
        spread = self.partner_spread()
        meta = {"ok": True, "inner_step": sketch.inner_step, "outer_round": sketch.outer_round,
                "round_steps": sketch.round_steps}
        tensors = [sketch.rows()] + ([torch.tensor(spread, dtype=torch.float32)] if spread is not None else [])
        return encode_frame(meta, tensors)

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
        request = encode_frame({"kind": "sketch", "spec": self.spec_hash, "seed": seed, "buckets": SKETCH_BUCKETS})
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
                        outer_round=worker.outer_round, round_steps=worker.inner_step - worker.last_round_step,
                        seed=seed)

"""A stage of peers for state-download tests, in process: replicas of stage 1 that
answer status, state and sketch requests as the node's handlers do, and a joiner whose
transport is the stage. Peers can be made silent (a sketch request times out) or busy
(every sketch and status request is told "busy"), the way flooding keeps them."""

from __future__ import annotations

import torch
from parts import StageParts, record

from swarm_node.errors import PeerError, PeerRefused
from swarm_node.net import protocols
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import encode_frame
from swarm_node.wire.state_codec import StateDecoder, encoded_snapshot

SPEC = RunSpec(run_id="checked", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
               samples_per_step=4)
STEP, ROUND = 500, 25


def replica(base: StageWorker, seed: int, scale: float = 1.0) -> StageParts:
    """A replica of stage 1 at step STEP: the base's phi apart by an honest spread,
    a round's momentum and some progress (times ``scale``: a hostile donor's 1.5)."""
    gen = torch.Generator().manual_seed(seed)
    worker = StageWorker(SPEC, 1, 16)
    for p, q, phi, m in zip(worker.params, base.params, worker.slow.phi, worker.slow.momentum):
        m.copy_(torch.randn(q.shape, generator=gen) * 1e-3)
        phi.copy_((q.detach() + torch.randn(q.shape, generator=gen) * 5e-4) * scale)
        p.data.copy_(phi + torch.randn(q.shape, generator=gen) * 5e-4)
    worker.inner.step_count, worker.outer_round, worker.last_round_step = STEP, ROUND, STEP - 2
    return StageParts(SPEC, worker)


def as_sent(worker: StageWorker) -> list[torch.Tensor]:
    """``worker``'s snapshot as a joiner decodes it from the wire (StageWorker.snapshot's layout)."""
    shapes, slow = [p.shape for p in worker.params], worker.slow is not None
    decoder = StateDecoder(shapes, slow)
    decoder.feed(encoded_snapshot(worker.snapshot(), len(shapes), slow)["tensors"])
    return decoder.finish()


class Stage:
    """Peers of stage 1 answering status, state and sketch requests in process."""

    def __init__(self, peers: dict[str, StageParts], *, silent: tuple[str, ...] = (), busy: tuple[str,
                                                                                                  ...] = ()):
        self.syncs = {p: parts.state_sync() for p, parts in peers.items()}
        self.witnesses = {p: parts.witnesses() for p, parts in peers.items()}
        self.silent = silent  # exist, serve state, but never answer a sketch request
        self.busy = busy  # exist, serve state, but every sketch and status request is told "busy"
        self.asked: list[tuple[str, str]] = []

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
        self.asked.append((peer, protocol))
        if protocol == protocols.STATE:
            return await self.syncs[peer].handle("QmJoiner", payload)
        if peer in self.busy and protocol in (protocols.STATE_SKETCH, protocols.STATUS):
            raise PeerRefused(f"{peer} is busy")
        if protocol == protocols.STATE_SKETCH:
            if peer in self.silent:
                raise PeerError("timed out")
            answer = await self.witnesses[peer].handle("QmJoiner", payload)
            if not answer:  # what the transport makes of an empty frame
                raise PeerRefused(f"{peer} is busy")
            return answer
        return encode_frame({"kind": "status", "ok": True})


def joiner(stage: Stage, peers: dict[str, StageParts], **options) -> StageParts:
    parts = StageParts(SPEC, StageWorker(SPEC, 1, 16), transport=stage)
    parts.membership.peers = {1: {p: record(1, SPEC, inner_step=STEP) for p in peers}}
    parts.sync = parts.state_sync(**options)
    return parts

"""A chain of a run's stages in process, each stage's next hop the following stage's
forward handler, for tests of what crosses a stage boundary."""

from __future__ import annotations

import asyncio

import torch
from parts import StageParts, body_out, record

from swarm_node.net import protocols
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import decode_frame


class Chain:
    """Stages 0 .. S-1 of ``spec``, each stage's next hop the following stage's handler;
    every frame's bytes and every loss an answer carries are kept."""

    def __init__(self, spec: RunSpec, workers: list[StageWorker] | None = None, vocab: int = 20):
        self.parts = [StageParts(spec, w) for w in workers or [StageWorker(spec, s, vocab)
                                                                for s in range(spec.num_stages)]]
        self.requests: list[int] = []
        self.answers: list[int] = []
        self.losses: list[float] = []
        self.pipelines = [self.parts[-1].pipeline()]
        for s in range(len(self.parts) - 2, -1, -1):  # each stage's link is the next one's handler
            self.parts[s].transport = self._link(self.pipelines[0])
            self.parts[s].membership.peers = {s + 1: {f"QmStage{s + 1}": record(s + 1, spec)}}
            self.pipelines.insert(0, self.parts[s].pipeline())

    def _link(self, downstream):
        chain = self

        class Link:
            async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
                assert protocol == protocols.FORWARD
                body_out(pacing)
                answer = await downstream.handle_forward("QmCaller", payload)
                header, _ = decode_frame(answer)
                assert header["ok"], header
                chain.requests.append(len(payload))
                chain.answers.append(len(answer))
                if downstream.worker.is_last:
                    chain.losses.append(header["loss"])
                return answer

        return Link()

    def train(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        producer = self.pipelines[0]
        done = producer.stats.microbatches_done

        async def run():
            for inputs, targets in data:
                producer.in_flight += 1  # as produce() counts it before the hop
                await producer._run_microbatch(inputs, targets)

        asyncio.run(run())
        assert producer.stats.microbatches_lost == 0 and producer.stats.microbatches_done == done + len(data)

    def weights(self) -> list[list[torch.Tensor]]:
        return [[p.detach().clone() for p in parts.worker.params] for parts in self.parts]

"""What a node shows of its stage boundary (/api/status and /metrics): bytes per token
each way across each boundary it is on, and stage 0's share of time waiting on its link.
Micro-batches go to the handler of the node's own wiring (conductor: pipeline, report)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import torch
from test_refusal_counts import SPEC, serving_stage_1_node

from swarm_node.obs.endpoints import NodeStatus
from swarm_node.train.hop_work import forward_request
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import decode_frame


def test_a_node_shows_bytes_per_token_across_its_boundary_and_its_link_wait(tmp_path):
    g = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(0, 16, (4, 16), generator=g) for _ in range(2))
    request = forward_request({"kind": "fwd", "spec": SPEC.spec_hash(), "deadline_s": 30.0},
                              StageWorker(SPEC, 0, 16).forward(inputs), targets, SPEC.activation_codec)

    async def scenario():
        node, p2p = await serving_stage_1_node(tmp_path)
        answers = [await node.pipeline.handle_forward("QmFirst", request) for _ in range(2)]
        node.stats.link_wait_s = 30.0  # as stage 0 counts it: a full window, 30 s of the 120 s trained
        node._training_since = time.monotonic() - 120.0
        pages = NodeStatus(node.report)
        return answers, pages.status(), pages.metrics()

    answers, status, metrics = asyncio.run(scenario())
    answer = answers[0]
    assert decode_frame(answer)[0]["ok"] is True and len(answers[0]) == len(answers[1])
    stats = json.loads(status.body)["stats"]
    tokens = 2 * targets.numel()
    assert stats["boundaries"] == {"0-1": {"sent": round(2 * len(answer) / tokens, 2),
                                           "received": round(2 * len(request) / tokens, 2), "tokens": tokens}}
    assert 0.24 <= stats["link_wait_share"] <= 0.26
    text = metrics.body.decode()
    samples = dict(re.findall(r'^swarm_node_boundary_bytes_per_token\{peer="QmNode",stage="1",boundary="0-1",'
                              r'direction="([a-z]+)"\} ([0-9.]+)$', text, re.MULTILINE))
    assert samples == {"sent": str(stats["boundaries"]["0-1"]["sent"]),
                       "received": str(stats["boundaries"]["0-1"]["received"])}
    assert re.search(r'^swarm_node_link_wait_share\{peer="QmNode",stage="1"\} 0\.2[456]', text, re.MULTILINE)

"""Refusals counted by reason (net/refusals.py): the transport counts the streams its caps
turn away, the guard what peers sent; a node shows both in /api/status and /metrics.
Streams come through a fake p2p daemon (tests/inproc/parts.py), so the node's own wiring
(conductor: transport, components, handlers) is what answers them."""

from __future__ import annotations

import asyncio
import json
import re

from parts import FakeDHT, FakeP2P, framed, stream_to

from swarm_node.data.source import RunData
from swarm_node.data.spec import DataSpec
from swarm_node.membership.view import Membership
from swarm_node.net import protocols
from swarm_node.net.dht import DhtOps
from swarm_node.net.refusals import REASONS, Refusals
from swarm_node.net.transport import ServeLimits, Transport
from swarm_node.node.conductor import Node
from swarm_node.node_config import NodeConfig
from swarm_node.obs.endpoints import NodeStatus
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker

SPEC = RunSpec(run_id="counts", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
               samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=50),
               inner=InnerHyper(lr=1e-3, warmup_steps=1, total_steps=100))


def test_the_transport_counts_what_its_caps_turn_away_by_reason():
    async def scenario():
        refusals, faults = Refusals(), []
        transport = Transport(FakeP2P(), on_fault=lambda peer, why: faults.append(peer), refusals=refusals)
        entered, release = asyncio.Event(), asyncio.Event()

        async def held(remote, request):
            entered.set()
            await release.wait()
            return b"done"

        limits = ServeLimits(max_request_bytes=16, max_concurrent=1, first_bytes_timeout_s=0.05)
        await transport.serve("/held", held, limits, authorize=lambda peer: peer != "QmStranger")
        p2p = transport.p2p
        stranger = await stream_to(p2p, "/held", framed(b"hi"), caller="QmStranger")
        oversize = await stream_to(p2p, "/held", (17).to_bytes(8, "big"), caller="QmBig")
        # sends nothing, never ends
        stalled = await stream_to(p2p, "/held", b"", caller="QmSilent", end=False)
        holder = asyncio.create_task(stream_to(p2p, "/held", framed(b"hi"), caller="QmHolder"))
        await entered.wait()
        busy = await stream_to(p2p, "/held", framed(b"hi"), caller="QmLate")
        release.set()
        answer = await holder
        return refusals.as_dict(), faults, (stranger, oversize, stalled, busy, answer)

    counts, faults, (stranger, oversize, stalled, busy, answer) = asyncio.run(scenario())
    assert stranger == oversize == stalled == b"" and busy == framed(b"") and answer == framed(b"done")
    assert counts == {**dict.fromkeys(REASONS, 0), "not-admitted": 1, "oversize": 1, "stalled": 1, "busy": 1}
    # refused for what they did; the stranger and the late caller are not
    assert faults == ["QmBig", "QmSilent"]


async def serving_stage_1_node(tmp_path) -> tuple[Node, FakeP2P]:
    """A stage-1 node wired and serving as conductor._serve does, on a fake p2p daemon."""
    node = Node(SPEC, NodeConfig(lane_port=None))
    p2p = FakeP2P()
    node.dht = NodeDHT(p2p)
    await node._new_transport()
    node.membership = Membership(spec=SPEC, dht=FakeDHT("QmNode"), guard=node.guard, config=node.config,
                                 record=node.report.record)
    node.membership.stage, node.membership.state = 1, "training"
    node.worker = StageWorker(SPEC, 1, 16)
    node.data = RunData(SPEC, cache_dir=tmp_path, cache_gb=None, initial_peers=[], peers=list,
                        on_fault=node.guard.fault, progress=False)
    node._build_components()
    await node._serve()
    return node, p2p


class NodeDHT:
    """What a node's start-up asks of its DHT before it serves: its p2p daemon."""

    def __init__(self, p2p: FakeP2P):
        self.p2p, self.peer_id, self.ops = p2p, "QmNode", DhtOps()

    async def replicate_p2p(self):
        return self.p2p

    def is_alive(self) -> bool:
        return True


def test_a_nodes_refusals_show_under_their_reason_in_its_status_json_and_metrics(tmp_path):
    """Bad requests to the node's real handlers, as it serves them (conductor._serve)."""
    async def scenario():
        node, p2p = await serving_stage_1_node(tmp_path)
        before = NodeStatus(node.report).status()
        answers = [await stream_to(p2p, protocols.STATUS, framed(b"not a frame"), caller="QmA"),
                   await stream_to(p2p, protocols.FORWARD, framed(b"\x00" * 3), caller="QmB"),
                   await stream_to(p2p, protocols.FORWARD, (1 << 40).to_bytes(8, "big"), caller="QmC")]
        pages = NodeStatus(node.report)
        return before, pages.status(), pages.metrics(), answers

    before, status, metrics, answers = asyncio.run(scenario())
    assert json.loads(before.body)["stats"]["refusals"] == dict.fromkeys(REASONS, 0)
    assert answers[0] and answers[1] and answers[2] == b""  # two answered "protocol", one cut off unread
    counts = json.loads(status.body)["stats"]["refusals"]
    assert counts == {**dict.fromkeys(REASONS, 0), "malformed": 2, "oversize": 1}
    text = metrics.body.decode()
    assert "# TYPE swarm_node_refusals_total counter" in text
    samples = dict(
        re.findall(
            r'^swarm_node_refusals_total\{peer="QmNode",stage="1",reason="([a-z-]+)"\} (\d+)$',
            text,
            re.MULTILINE,
        )
    )
    assert samples == {reason: str(counts[reason]) for reason in REASONS}  # every reason, zeros too: bounded


def test_a_bootstraps_refusals_are_on_its_status_page_and_metrics(tmp_path):
    """A bootstrap has no guard: its transport counts, and its dial-back faults count there."""
    from swarm_bootstrap.peer import BootstrapConfig, BootstrapPeer
    from swarm_bootstrap.view import SwarmView

    from swarm_node.net.dialback import DIALBACK, serve_dialback

    async def scenario():
        bootstrap = BootstrapPeer(BootstrapConfig(identity_path=tmp_path / "identity.key"))
        bootstrap.dht, bootstrap.spec = NodeDHT(FakeP2P()), SPEC
        bootstrap.view = SwarmView(SPEC.run_id, SPEC.spec_hash(), SPEC.num_stages)
        bootstrap.transport = Transport(bootstrap.dht.p2p)
        await serve_dialback(bootstrap.transport, authorize=lambda peer: peer != "QmStranger")
        await stream_to(bootstrap.dht.p2p, DIALBACK, framed(b"junk"), caller="QmA")
        await stream_to(bootstrap.dht.p2p, DIALBACK, framed(b"junk"), caller="QmStranger")
        return bootstrap.status(), bootstrap._routes()["/metrics"]()

    status, metrics = asyncio.run(scenario())
    counts = {**dict.fromkeys(REASONS, 0), "malformed": 1, "not-admitted": 1}
    assert status["refusals"] == counts
    pattern = r'^swarm_bootstrap_refusals_total\{reason="([a-z-]+)"\} (\d+)$'
    samples = dict(re.findall(pattern, metrics.body.decode(), re.MULTILINE))
    assert samples == {reason: str(n) for reason, n in counts.items()}

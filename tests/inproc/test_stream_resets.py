"""A forward call whose stream ends before the answer (a reset inside the libp2p daemons,
about once per thousand healthy calls) is retried at once and costs the peer nothing;
the second in a row from the same peer bans it as before (a peer that refuses us)."""

import asyncio

import torch

from swarm_node import __version__
from swarm_node.errors import StreamClosed
from swarm_node.node import Node
from swarm_node.node_config import NodeConfig
from swarm_node.spec import RunSpec
from swarm_node.wire.codec import FrameLimits, encode_frame
from swarm_node.wire.records import PeerRecord

SPEC = RunSpec(run_id="resets", model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=4)
HIDDEN = torch.zeros(4, 16, 64)


class ScriptedTransport:
    """Answers forward calls from a script: an exception to raise, or a loss to answer with."""

    def __init__(self, script):
        self.script = list(script)
        self.calls = []

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes):
        self.calls.append(peer)
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return encode_frame({"ok": True, "loss": step}, [torch.zeros_like(HIDDEN).half()])


def node_with(script, peers=("QmNext",)) -> Node:
    node = Node(SPEC, NodeConfig())
    node._adopt_spec(SPEC)
    node.stage = 0
    node.dht = type("D", (), {"peer_id": "QmSelf"})()
    node.transport = ScriptedTransport(script)
    node.frame_limits = FrameLimits(max_payload_bytes=1 << 20)
    node.peers = {1: {p: PeerRecord(stage=1, spec_hash=SPEC.spec_hash(), version=__version__) for p in peers}}
    return node


def send(node: Node):
    return asyncio.run(node._send_downstream(HIDDEN, torch.zeros(4, 16, dtype=torch.long), timeout_s=10.0))


def failures_reported(node: Node) -> list[str]:
    reported = []
    report = node.chooser.report_failure
    node.chooser.report_failure = lambda peer: reported.append(peer) or report(peer)
    return reported


def test_one_stream_closed_before_the_answer_is_retried_without_a_ban():
    node = node_with([StreamClosed("stream closed mid-frame"), 2.5])
    banned = failures_reported(node)
    grad, loss = send(node)
    assert loss == 2.5 and node.transport.calls == ["QmNext", "QmNext"] and node.stats.retries == 1
    node.transport.script = [StreamClosed("stream closed mid-frame"), 2.4]  # a success in between: still once
    assert send(node)[1] == 2.4
    assert banned == [] and not node.chooser.is_banned("QmNext")


def test_two_in_a_row_ban_the_peer_and_the_micro_batch_goes_elsewhere():
    node = node_with([StreamClosed("stream closed mid-frame"), 2.0], peers=("QmNext", "QmOther"))
    node.chooser.choose = lambda candidates, exclude=frozenset(): next(
        (c.peer_id for c in sorted(candidates, key=lambda c: c.peer_id != "QmNext")
         if c.peer_id not in exclude and not node.chooser.is_banned(c.peer_id)), None)
    node._streams_closed["QmNext"] = 1  # the last call to it ended the same way
    banned = failures_reported(node)
    _, loss = send(node)
    assert banned == ["QmNext"] and node.chooser.is_banned("QmNext") and loss == 2.0
    assert node.transport.calls == ["QmNext", "QmOther"]

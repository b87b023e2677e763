"""A forward call whose stream ends before the answer (a reset inside the libp2p daemons,
about once per thousand healthy calls) is retried at once and costs the peer nothing;
the second in a row from the same peer bans it as before (a peer that refuses us)."""

import torch
import vclock
from parts import StageParts, body_out, record

from swarm_node.errors import StreamClosed
from swarm_node.spec import RunSpec
from swarm_node.train.hop_work import outgoing
from swarm_node.train.pipeline import Pipeline
from swarm_node.train.worker import StageWorker
from swarm_node.wire.activations import encode_activations
from swarm_node.wire.frames import encode_frame

SPEC = RunSpec(run_id="resets", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
               samples_per_step=4)
HIDDEN = torch.zeros(4, 16, 64)


class ScriptedTransport:
    """Answers forward calls from a script: an exception to raise, or a loss to answer with."""

    def __init__(self, script):
        self.script = list(script)
        self.calls = []

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
        self.calls.append(peer)
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        body_out(pacing)
        return encode_frame({"ok": True, "loss": step}, encode_activations(torch.zeros_like(HIDDEN), "fp16"))


class Stage0:
    """Stage 0's pipeline with scripted next-stage peers; records the bans it hands out."""

    def __init__(self, script, peers=("QmNext",)):
        self.transport = ScriptedTransport(script)
        self.parts = StageParts(SPEC, StageWorker(SPEC, 0, 16), transport=self.transport)
        self.parts.membership.peers = {1: {p: record(1, SPEC) for p in peers}}
        for peer in peers:  # peers that served us before: both are routed to, not probed one at a time
            self.parts.guard.reached(peer)
        self.banned: list[str] = []
        failed = self.parts.guard.failed
        self.parts.guard.failed = lambda peer: self.banned.append(peer) or failed(peer)
        self.pipeline: Pipeline = self.parts.pipeline()

    def send(self):
        return vclock.run(self.pipeline.next_hop.send(*outgoing(HIDDEN, SPEC.activation_codec),
                                                      torch.zeros(4, 16, dtype=torch.long), timeout_s=10.0))


def test_one_stream_closed_before_the_answer_is_retried_without_a_ban():
    stage = Stage0([StreamClosed("stream closed mid-frame"), 2.5])
    grad, loss = stage.send()
    assert loss == 2.5 and stage.transport.calls == ["QmNext", "QmNext"] and stage.parts.stats.retries == 1
    # a success in between: still once
    stage.transport.script = [StreamClosed("stream closed mid-frame"), 2.4]
    assert stage.send()[1] == 2.4
    assert stage.banned == [] and not stage.parts.guard.is_banned("QmNext")


def test_two_in_a_row_ban_the_peer_and_the_micro_batch_goes_elsewhere():
    stage = Stage0([StreamClosed("stream closed mid-frame"), 2.0], peers=("QmNext", "QmOther"))
    guard = stage.parts.guard
    stage.pipeline.next_hop.chooser.choose = lambda candidates, exclude=frozenset(), **link: next(
        (c.peer_id for c in sorted(candidates, key=lambda c: c.peer_id != "QmNext")
         if c.peer_id not in exclude and not guard.is_banned(c.peer_id)), None)
    assert guard.stream_closed("QmNext") is False  # the last call to it ended the same way: forgiven then
    _, loss = stage.send()
    assert stage.banned == ["QmNext"] and guard.is_banned("QmNext") and loss == 2.0
    assert stage.transport.calls == ["QmNext", "QmOther"]

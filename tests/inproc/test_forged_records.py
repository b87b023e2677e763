"""Forged registry records (fresh keys, a huge claimed throughput, `seeking`) took most
of a stage-0 node's routing weight and filled its partner search: 277 failed hops and
32 lost micro-batches in 90 s in a red-team run. Claims are not believed: routing
weighs what it measured, and peers nobody has reached are tried one at a time."""

import random

import torch
import vclock
from parts import StageParts, body_out, record

from swarm_node.errors import NotEnoughPeers, PeerError
from swarm_node.net import protocols
from swarm_node.spec import RunSpec
from swarm_node.train.hop_work import outgoing
from swarm_node.train.worker import StageWorker
from swarm_node.wire.activations import encode_activations
from swarm_node.wire.frames import encode_frame

SPEC = RunSpec(run_id="forged", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
               samples_per_step=4)
HIDDEN = torch.zeros(4, 16, 64)
HONEST = ("QmHonestA", "QmHonestB")
FORGED = tuple(f"QmForged{i:02d}" for i in range(30))


class Swarm:
    """Two honest stage-1 peers that answer, thirty forged ones nobody can reach."""

    def __init__(self):
        self.calls = {"honest": 0, "forged": 0}

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
        if peer in FORGED:
            self.calls["forged"] += 1
            raise PeerError("Connect failed. msg=routing: not found")
        self.calls["honest"] += 1
        body_out(pacing)
        return encode_frame({"ok": True, "loss": 2.0}, encode_activations(torch.zeros_like(HIDDEN), "fp16"))


def stage_0(swarm: Swarm) -> StageParts:
    stage = StageParts(SPEC, StageWorker(SPEC, 0, 16), transport=swarm)
    stage.membership.peers = {
        0: {p: record(0, SPEC, throughput=1e9, seeking=True) for p in FORGED},
        1: {**{p: record(1, SPEC, throughput=1e9, seeking=True, loss=0.001) for p in FORGED},
            **{p: record(1, SPEC, throughput=50.0) for p in HONEST}}}
    for peer in HONEST:
        stage.guard.reached(peer)  # they served us before
    return stage


def test_forged_next_stage_records_cost_no_micro_batch_and_one_probe_each():
    swarm = Swarm()
    stage = stage_0(swarm)
    pipeline = stage.pipeline()
    pipeline.next_hop.chooser.rng = random.Random(0)

    async def send_many():
        lost = 0
        for _ in range(200):
            try:
                await pipeline.next_hop.send(*outgoing(HIDDEN, SPEC.activation_codec),
                                             torch.zeros(4, 16, dtype=torch.long), timeout_s=30.0)
            except (PeerError, NotEnoughPeers, TimeoutError):
                lost += 1
        return lost

    lost = vclock.run(send_many())
    assert lost == 0 and swarm.calls["honest"] == 200
    assert swarm.calls["forged"] <= len(FORGED)  # each probed once, then banned
    assert not any(stage.guard.is_verified(p) for p in FORGED)


def test_forged_same_stage_records_never_fill_the_partner_search():
    stage = stage_0(Swarm())
    stage.membership.stage = 0
    stage.guard.reached("QmPartner")
    stage.membership.peers[0]["QmPartner"] = record(0, SPEC)
    for _ in range(20):
        candidates = [peer for peer, _ in stage.membership.partner_candidates()]
        assert "QmPartner" in candidates and len(candidates) == 2  # the verified one and one probe
    assert not stage.membership.callers_expected()


def test_forged_records_claiming_to_be_far_ahead_do_not_keep_a_joiner_from_the_stage_state():
    """Ordered by the steps they claim, 30 forged stage-1 records took every donor slot:
    a joiner tried three of them and started from scratch, and a node that fell behind
    never caught up. Donors must exist first: a status request answers that at once."""
    donor_worker = StageWorker(SPEC, 1, 16)
    donor_worker.inner.step_count = 500
    donor = StageParts(SPEC, donor_worker).state_sync()
    asked = {"forged": 0, "honest": 0}

    class Transport:
        async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
            if peer in FORGED:
                asked["forged"] += 1
                raise PeerError("Connect failed. msg=routing: not found")
            asked["honest"] += 1
            if protocol == protocols.STATE:
                return await donor.handle("QmJoiner", payload)
            return encode_frame({"kind": "status", "ok": True})

    joiner = StageParts(SPEC, StageWorker(SPEC, 1, 16), transport=Transport())
    joiner.membership.peers = {1: {**{p: record(1, SPEC, inner_step=10**9) for p in FORGED},
                                   "QmDonor": record(1, SPEC, inner_step=500)}}
    assert vclock.run(joiner.state_sync().download())
    assert joiner.worker.inner_step == 500 and joiner.stats.downloaded_from == "QmDonor"
    assert asked["forged"] == len(FORGED)  # one status request each, at once
    assert all(joiner.guard.is_banned(p) for p in FORGED)

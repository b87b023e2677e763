"""The outer round runs on any pairing that keeps the interface of
gossip/round_pairing.py: here one that is neither NoLoCo's pairs nor DiLoCo's group.
The round asks it whom to exchange with, the proposal handler asks it whether it hears
proposals, and the payload handler hands it what comes; nothing takes a path by kind
(tests/unit/test_pairing_seam.py reads the source for that)."""

import asyncio

import pytest
import torch
import vclock
from parts import StageParts, payload_of, record

from swarm_node.data.spec import DataSpec
from swarm_node.gossip.pairing import PairState, Refused
from swarm_node.gossip.round_pairing import GroupPairing, PairPairing, RoundCalls, round_pairing
from swarm_node.net import protocols
from swarm_node.node_config import NodeConfig
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import decode_frame, encode_frame

SPEC = RunSpec(run_id="seam", outer_codec="fp16", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
               samples_per_step=4, data=DataSpec(kind="synthetic"),
               method=default_method("noloco", inner_steps=2),
               inner=InnerHyper(lr=1e-3, warmup_steps=1, total_steps=100))


class OnePeerPairing:
    """Exchanges with the first candidate, whole payloads, no proposals: what it was asked, in order."""

    delta_ahead = False
    abandoned = None
    served_s = 1.0

    def __init__(self):
        self.state = PairState.IDLE
        self.seeking = asyncio.Event()
        self.asked: list[str] = []
        self.taken: list[tuple[str, object]] = []

    async def gather(self, round_no: int, payload, calls: RoundCalls, expect_request: bool):
        self.asked.append("gather")
        self.state = PairState.SEEKING
        self.seeking.set()
        try:
            peer = calls.candidates()[0][0]
            calls.agreed()
            return [(peer, await calls.send(peer, payload, self.served_s))]
        finally:
            self.state = PairState.IDLE
            self.seeking.clear()

    def meets_seekers(self) -> bool:
        self.asked.append("meets_seekers")
        return False

    def admit_proposal(self) -> None:
        self.asked.append("admit_proposal")
        raise Refused("one-peer")

    def on_propose(self, remote):
        raise AssertionError("not admitted, so never asked")

    def hold_for(self, remote):
        self.asked.append("hold_for")

    def drop_hold(self, remote):
        self.asked.append("drop_hold")

    def withdrawn(self, remote):
        return False

    def may_fetch(self, remote) -> bool:
        return self.state is not PairState.IDLE

    async def take(self, remote, request, intake) -> None:
        self.asked.append("take")
        self.taken.append((remote, await intake.take(remote, request)))

    def round_over(self) -> None:
        self.asked.append("round_over")


def stage_with(pairing: OnePeerPairing, transport=None) -> tuple[StageParts, object]:
    stage = StageParts(SPEC, StageWorker(SPEC, 1, 16), config=NodeConfig(round_timeout_s=5.0))
    stage.membership.peers = {1: {"QmPartner": record(1, SPEC)}}
    stage.transport = transport
    exchange = stage.exchange()
    exchange.pairing = exchange.payloads.pairing = pairing
    return stage, exchange


def test_a_round_on_a_pairing_of_neither_kind_averages_with_the_peer_it_gathers():
    partner = StageWorker(SPEC, 1, 16)
    header = {"kind": "outer", "spec": SPEC.spec_hash(), "round": 0, "ok": True}
    phi, delta = payload_of(partner, torch.float16)
    calls = []

    class Partner:  # takes our whole payload and serves its own whole
        async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
            calls.append((peer, protocol, decode_frame(payload)[0].get("part")))
            if protocol == protocols.OUTER_FETCH:
                return encode_frame(header, [*phi, *delta])
            return encode_frame({"kind": "outer", "ok": True})

    pairing = OnePeerPairing()
    stage, exchange = stage_with(pairing, Partner())
    before = [p.detach().clone() for p in stage.worker.params]
    outcome = vclock.run(exchange.run_round())
    assert outcome.partners == ["QmPartner"]
    assert outcome.partner_at is not None and outcome.exchange_s is not None
    assert pairing.asked == ["gather", "round_over"]
    # the pairing said "whole": our payload went as one frame, and the partner's was fetched whole
    assert sorted(calls) == sorted([("QmPartner", protocols.OUTER, None),
                                    ("QmPartner", protocols.OUTER_FETCH, None)])
    assert stage.stats.rounds_with_partner == 1 and stage.worker.outer_round == 1
    assert any(not torch.equal(a, b) for a, b in zip(stage.worker.params, before))


def test_proposals_and_payloads_are_answered_by_the_pairings_rule():
    pairing = OnePeerPairing()
    stage, exchange = stage_with(pairing)
    proposal = encode_frame({"kind": "propose", "spec": SPEC.spec_hash(), "round": 0})
    answer, _ = decode_frame(vclock.run(exchange.handle_propose("QmPartner", proposal)))
    assert answer == {"v": 1, "ok": False, "error": "one-peer"}
    vclock.run(exchange.meet_a_seeking_peer())  # the pairing says no: no round opens early
    assert not stage.gate.in_round

    phi, delta = payload_of(StageWorker(SPEC, 1, 16), torch.float16)
    header = {"kind": "outer", "spec": SPEC.spec_hash(), "round": 0, "ok": True}
    payload = encode_frame(header, [*phi, *delta])
    verdict, _ = decode_frame(vclock.run(exchange.payloads.handle_outer("QmPartner", payload)))
    assert verdict["ok"] and [peer for peer, _ in pairing.taken] == ["QmPartner"]
    assert pairing.asked == ["admit_proposal", "meets_seekers", "take"]


def test_the_spec_method_picks_the_kind():
    settings = dict(round_timeout_s=5.0, exchange_s=2.0, link_s=None, propose_timeout_s=1.0, own_id="QmSelf",
                    served_at_once=4)
    pairs, group = round_pairing("noloco", **settings), round_pairing("diloco", **settings)
    assert isinstance(pairs, PairPairing) and pairs.delta_ahead and pairs.served_s == 2.0
    assert isinstance(group, GroupPairing) and not group.delta_ahead
    assert group.served_s == group.call_s(4 + 4) == 16.0  # its own calls and those served share the link
    with pytest.raises(Refused, match="not-pairing"):
        group.admit_proposal()

"""A node's outer round as its peers see it: the registry record says `seeking` while
the round is open, and a round that finds no partner ends in the local-only step."""

import torch
import vclock
from parts import StageParts, fetched_part, partner_payload, payload_of, record

from swarm_node.data.spec import DataSpec
from swarm_node.net import protocols
from swarm_node.node_config import NodeConfig
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import encode_frame

# fp16 payloads: the partner's floats are what these tests shape (codecs: tests/unit/test_outer_codec.py)
SPEC = RunSpec(run_id="rounds", outer_codec="fp16", model_size="debug", num_stages=2, seq_len=16,
               batch_size=4, samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=2),
               inner=InnerHyper(lr=1e-3, warmup_steps=1, total_steps=100))


def test_the_record_says_seeking_while_the_round_is_open():
    stage = StageParts(SPEC, StageWorker(SPEC, 1, 16), config=NodeConfig(round_timeout_s=0.5))
    stage.membership.peers = {1: {"QmOther": record(1, SPEC)}}
    proposals = []

    class Refusing:  # every peer answers our proposals "busy"
        async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
            assert protocol == protocols.PAIR
            proposals.append(peer)
            return encode_frame({"ok": False, "error": "busy"})

    stage.transport = Refusing()
    exchange = stage.exchange()

    async def round_then_heartbeat():  # as the node runs it: the record is published after the round
        await exchange.run_round()
        await exchange.announce()

    vclock.run(round_then_heartbeat())  # the 0.5 s round deadline passes in virtual time
    # announced as the round opened, not at the next heartbeat
    assert stage.announced[0] is True, stage.announced
    assert stage.announced[-1] is False  # and withdrawn after it
    assert proposals and set(proposals) == {"QmOther"}
    assert stage.stats.local_only_rounds == 1 and stage.worker.outer_round == 1
    assert stage.stats.rounds_alone == 0  # a peer was there: a round without a partner, not a round alone


def test_a_node_alone_in_its_stage_takes_the_local_only_step_at_once_and_counts_it_apart():
    stage = StageParts(SPEC, StageWorker(SPEC, 1, 16), config=NodeConfig(round_timeout_s=30.0))
    outcome = vclock.run(stage.exchange().run_round())
    assert outcome.partners == [] and outcome.seconds < 1.0  # no waiting out the 30 s deadline
    assert (stage.stats.local_only_rounds, stage.stats.rounds_alone) == (1, 1)


def test_a_proposal_whose_answer_is_lost_to_a_stream_reset_is_asked_again_without_a_ban():
    """Honest stage-0 partners were banned after "failed to answer a proposal: stream
    closed mid-frame" (a reset inside the daemons) and took local-only rounds. The
    proposal is asked again (a peer that reserved itself for us says yes again, see
    test_pairing.py); two resets in a row still count as a failure."""
    from swarm_node.errors import StreamClosed

    def partner(resets: int):
        calls = []
        worker = StageWorker(SPEC, 1, 16)
        answers = partner_payload(SPEC, *payload_of(worker, torch.float16))

        class Partner:  # accepts our proposal, but the first `resets` answers are lost
            async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
                calls.append(protocol)
                if protocol == protocols.PAIR and calls.count(protocols.PAIR) <= resets:
                    raise StreamClosed("stream closed mid-frame")
                if protocol == protocols.OUTER_FETCH:
                    return answers[fetched_part(payload)]
                return {protocols.PAIR: encode_frame({"kind": "propose", "ok": True}),
                        protocols.OUTER: encode_frame({"kind": "outer", "ok": True})}[protocol]

        return Partner(), calls

    for resets, paired in ((1, True), (2, False)):
        transport, calls = partner(resets)
        stage = StageParts(SPEC, StageWorker(SPEC, 1, 16), transport=transport,
                           config=NodeConfig(round_timeout_s=0.5))
        stage.membership.peers = {1: {"QmOther": record(1, SPEC, seeking=True)}}
        outcome = vclock.run(stage.exchange().run_round())
        if paired:
            # then our payload and its, each as two parts (Delta ahead of phi)
            assert outcome.partners == ["QmOther"] and calls[:2] == [protocols.PAIR, protocols.PAIR]
            assert sorted(calls[2:]) == sorted([protocols.OUTER, protocols.OUTER_FETCH] * 2)
            assert not stage.guard.is_banned("QmOther")
        else:
            assert outcome.partners == [] and stage.guard.is_banned("QmOther")

"""Refusals that name peers seen seeking (gossip/seekers.py): the answering side names
the proposers it refused lately, the proposing side tries the named peers first, but
only verified peers of its own view, and a malformed hint is a fault of the refuser.
On the virtual clock, so the freshness window passes without real time."""

import asyncio

import pytest
from parts import StageParts, record

from swarm_node.data.spec import DataSpec
from swarm_node.errors import ProtocolError
from swarm_node.gossip.pairing import HINTED, Refused
from swarm_node.gossip.seekers import SEEKER_FRESH_S
from swarm_node.optim import InnerHyper, default_method
from swarm_node.scale.vclock import run
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import encode_frame
from swarm_node.wire.messages import refusal, refusal_hints

SPEC = RunSpec(run_id="hints", model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=50),
               inner=InnerHyper(lr=1e-3, warmup_steps=1, total_steps=100))
PROPOSAL = encode_frame({"kind": "propose", "spec": SPEC.spec_hash(), "round": 0})


class ScriptedTransport:
    """Answers every proposal with ``answer``."""

    def __init__(self, answer: bytes):
        self.answer = answer

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **_):
        return self.answer


def parts_with_view(answer: bytes, view: dict[str, bool]) -> StageParts:
    """A stage-0 node whose registry view holds ``view``'s peers (verified or not)."""
    parts = StageParts(SPEC, StageWorker(SPEC, 0, 16), transport=ScriptedTransport(answer))
    parts.membership.peers[0] = {peer: record(0, SPEC) for peer in view}
    for peer, verified in view.items():
        if verified:
            parts.guard.reached(peer)
    return parts


def test_a_refusal_names_the_proposers_refused_lately_but_not_the_asker():
    async def scenario():
        exchange = StageParts(SPEC, StageWorker(SPEC, 0, 16)).exchange()
        first = await exchange.handle_propose("QmFirst", PROPOSAL)  # idle at step 0: not ready
        assert refusal_hints(first) == []
        second = await exchange.handle_propose("QmSecond", PROPOSAL)
        again = await exchange.handle_propose("QmFirst", PROPOSAL)
        await asyncio.sleep(SEEKER_FRESH_S + 0.1)
        stale = await exchange.handle_propose("QmThird", PROPOSAL)
        return refusal_hints(second), refusal_hints(again), refusal_hints(stale)

    second, again, stale = run(scenario())
    assert second == ["QmFirst"]
    assert again == ["QmSecond"]  # never the asker itself
    assert stale == []  # proposers heard longer ago than the window have likely paired


def test_hinted_peers_of_our_verified_view_are_tried_first_and_others_ignored():
    async def scenario():
        answer = refusal("busy", ["QmSeeker", "QmStranger", "QmUnverified", "QmSelf"])
        parts = parts_with_view(answer,
                                {"QmRefuser": True, "QmSeeker": True, "QmOther": True, "QmUnverified": False})
        exchange = parts.exchange(own_id="QmSelf")
        with pytest.raises(Refused):
            await exchange._send_proposal("QmRefuser", 1.0)
        ranked = dict(exchange._pairing_candidates())
        await asyncio.sleep(SEEKER_FRESH_S + 0.1)
        return ranked, dict(exchange._pairing_candidates())

    ranked, later = run(scenario())
    assert ranked["QmSeeker"] == HINTED
    assert "QmStranger" not in ranked  # not in our view: a hint never adds a peer
    assert ranked.get("QmUnverified", 0) < HINTED  # a claim about a peer nobody reached is not believed
    assert ranked["QmOther"] < HINTED
    assert later["QmSeeker"] < HINTED  # hints go stale


def test_a_hinted_peer_is_tried_once():
    async def scenario():
        parts = parts_with_view(refusal("busy", ["QmSeeker"]), {"QmRefuser": True, "QmSeeker": True})
        exchange = parts.exchange()
        with pytest.raises(Refused):
            await exchange._send_proposal("QmRefuser", 1.0)
        exchange.transport.answer = refusal("not-ready")
        with pytest.raises(Refused):
            await exchange._send_proposal("QmSeeker", 1.0)
        return dict(exchange._pairing_candidates())

    assert run(scenario())["QmSeeker"] < HINTED


@pytest.mark.parametrize("seekers", [["x" * 65], "QmOne", [1, 2], ["Qm/../etc"], [""], ["a", "b", "c", "d"],
                                     {"a": 1}])
def test_a_malformed_hint_is_a_protocol_error_counted_against_the_refuser(seekers):
    async def scenario():
        answer = encode_frame({"ok": False, "error": "busy", "seekers": seekers})
        parts = parts_with_view(answer, {"QmRefuser": True, "QmSeeker": True})
        exchange = parts.exchange()
        with pytest.raises(ProtocolError):
            await exchange._send_proposal("QmRefuser", 1.0)
        return parts.guard.faults("QmRefuser"), dict(exchange._pairing_candidates())

    faults, ranked = run(scenario())
    assert faults == 1
    assert max(ranked.values()) < HINTED

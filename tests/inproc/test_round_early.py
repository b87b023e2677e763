"""Rule 7 of gossip/pairing.py through the node's exchange: a proposal to a node past half
of its round opens that round early, and the round is the proposer's (it used to open
seeking, propose elsewhere in the same loop turn, and refuse its proposer ``busy``).
On the virtual clock."""

import asyncio

from parts import StageParts, record

from swarm_node.data.spec import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.scale.vclock import run
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import encode_frame
from swarm_node.wire.messages import answer_is_yes, refusal_ready_in_s

SPEC = RunSpec(run_id="early", model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=50),
               inner=InnerHyper(lr=1e-3, warmup_steps=1, total_steps=100))
PROPOSAL = encode_frame({"kind": "propose", "spec": SPEC.spec_hash(), "round": 0})


class CountingTransport:
    """Every proposal we send is accepted, and counted."""

    def __init__(self):
        self.proposed_to: list[str] = []

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **_):
        self.proposed_to.append(peer)
        await asyncio.sleep(0.05)
        return encode_frame({"kind": "propose", "ok": True})


def node_at_step(step: int) -> StageParts:
    parts = StageParts(SPEC, StageWorker(SPEC, 0, 16), transport=CountingTransport())
    parts.worker.inner.step_count = step
    parts.membership.peers[0] = {"QmElse": record(0, SPEC, seeking=True)}
    parts.guard.reached("QmElse")  # verified, and said to be seeking: the round's own first choice
    return parts


async def propose_to(parts: StageParts) -> tuple[bool, list[str]]:
    exchange = parts.exchange()

    async def round_loop():
        await parts.gate.next_round()
        await exchange.run_round()

    rounds = asyncio.create_task(round_loop())
    answer = await exchange.handle_propose("QmPuller", PROPOSAL)
    rounds.cancel()
    await asyncio.gather(rounds, return_exceptions=True)
    return answer_is_yes(answer)[0], parts.transport.proposed_to


def test_a_proposal_to_a_node_past_half_of_its_round_pairs_with_the_proposer():
    accepted, proposed_to = run(propose_to(node_at_step(30)))
    assert accepted and proposed_to == []


def test_a_node_before_half_of_its_round_refuses_and_does_not_open_it():
    parts = node_at_step(10)
    accepted, proposed_to = run(propose_to(parts))
    assert not accepted and proposed_to == [] and not parts.gate.in_round


def test_a_node_before_half_says_when_it_will_accept():
    """Opened 10 s ago and 10 of 50 steps in, it reaches half (25) in 15 s at that pace."""
    async def scenario():
        parts = node_at_step(0)
        exchange = parts.exchange()
        exchange._round_opened_at = asyncio.get_running_loop().time()
        await asyncio.sleep(10.0)
        parts.worker.inner.step_count = 10
        return await exchange.handle_propose("QmEarly", PROPOSAL)

    answer = run(scenario())
    assert answer_is_yes(answer) == (False, "not-ready")
    assert refusal_ready_in_s(answer) == 15.0

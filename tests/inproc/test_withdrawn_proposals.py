"""A proposal taken back (``withdraw`` on /swarm-node/pair) through the node's exchange,
on the virtual clock: the callee stops holding its round for a payload that will not
come, and a proposer whose proposal went unanswered, or that stops mid-proposal, says
so. (A joiner stopped right after a yes held a stage-0 peer's steps for 35 s, twice in
one run of tests/swarm/test_honest_joins_slow.py, and that peer fell 60 rounds behind
its stage.)"""

import asyncio

import pytest
from parts import StageParts, record

from swarm_node.data.spec import DataSpec
from swarm_node.errors import PeerTimeout, ProtocolError
from swarm_node.optim import InnerHyper, default_method
from swarm_node.scale.vclock import run
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import decode_frame, encode_frame
from swarm_node.wire.messages import answer_is_yes, check_pair_request

SPEC = RunSpec(run_id="withdraw", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
               samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=50),
               inner=InnerHyper(lr=1e-3, warmup_steps=1, total_steps=100))


def message(kind: str, round_no: int = 0) -> bytes:
    return encode_frame({"kind": kind, "spec": SPEC.spec_hash(), "round": round_no})


class SilentPeer:
    """Every proposal goes unanswered until the caller's deadline; withdrawals are kept."""

    def __init__(self):
        self.sent: list[tuple[str, str, int]] = []  # (peer, kind, round)

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **_):
        kind, round_no = check_pair_request(payload, SPEC.spec_hash())
        self.sent.append((peer, kind, round_no))
        if kind == "withdraw":
            return encode_frame({"kind": "withdraw", "ok": True})
        await asyncio.sleep(timeout_s)
        raise PeerTimeout("no answer")


def stage_at_step(step: int, transport=None) -> StageParts:
    parts = StageParts(SPEC, StageWorker(SPEC, 0, 16), transport=transport or SilentPeer())
    parts.worker.inner.step_count = step
    return parts


async def open_round(parts: StageParts):
    exchange = parts.exchange()

    async def rounds():
        await parts.gate.next_round()
        await exchange.run_round()

    return exchange, asyncio.create_task(rounds())


def test_a_withdrawal_frees_the_round_for_the_next_proposer():
    async def scenario():
        parts = stage_at_step(30)  # past half: a proposal opens the round, reserved for the proposer
        exchange, rounds = await open_round(parts)
        first = await exchange.handle_propose("QmGone", message("propose"))
        busy = await exchange.handle_propose("QmNext", message("propose"))
        taken_back = await exchange.handle_propose("QmGone", message("withdraw"))
        second = await exchange.handle_propose("QmNext", message("propose"))
        again = await exchange.handle_propose("QmGone", message("propose"))  # the round it took back: no
        rounds.cancel()
        await asyncio.gather(rounds, return_exceptions=True)
        return [answer_is_yes(a) for a in (first, busy, taken_back, second, again)]

    first, busy, taken_back, second, again = run(scenario())
    assert first[0] and busy == (False, "busy") and taken_back[0] and second[0] and again == (False,
                                                                                              "withdrawn")


@pytest.mark.parametrize("when", ["as-the-round-opens", "before-it-arrives"])
def test_a_withdrawal_while_the_proposal_is_answered_turns_it_into_a_refusal(when):
    """Taken back while our round opens for it (the handler waits up to 2.5 s for that),
    the proposal is refused and the round seeks; taken back before it arrives (its
    streams raced), it does not open our round at all."""
    async def scenario():
        parts = stage_at_step(30)
        exchange, rounds = await open_round(parts)
        if when == "before-it-arrives":
            await exchange.handle_propose("QmLate", message("withdraw", 3))
        proposal = asyncio.create_task(exchange.handle_propose("QmLate", message("propose", 3)))
        if when == "as-the-round-opens":
            while not parts.gate.in_round:  # the proposal is opening our round (held for it)
                await asyncio.sleep(0)
            assert exchange.pairing.state.value == "idle"  # not open yet: the handler waits for it
            await exchange.handle_propose("QmLate", message("withdraw", 3))
        answer = await proposal
        state = exchange.pairing.state.value
        rounds.cancel()
        await asyncio.gather(rounds, return_exceptions=True)
        return answer_is_yes(answer), state

    answer, state = run(scenario())
    assert answer == (False, "withdrawn")
    assert state == ("seeking" if when == "as-the-round-opens" else "idle")


def test_a_proposal_that_timed_out_is_withdrawn():
    async def scenario():
        parts = stage_at_step(50)  # at the boundary: the round opens and proposes at once
        parts.config = parts.config.__class__(round_timeout_s=8.0)
        parts.membership.peers[0] = {"QmSilent": record(0, SPEC, seeking=True)}
        parts.guard.reached("QmSilent")
        exchange, rounds = await open_round(parts)
        parts.gate.note_due(True)  # the boundary, as the data path reports it
        await rounds
        return parts.transport.sent, exchange.last

    sent, outcome = run(scenario())
    assert outcome.partners == []
    assert sent[:2] == [("QmSilent", "propose", 0), ("QmSilent", "withdraw", 0)]


def test_a_node_stopped_mid_proposal_withdraws_as_it_goes():
    async def scenario():
        parts = stage_at_step(50)
        parts.membership.peers[0] = {"QmSilent": record(0, SPEC, seeking=True)}
        parts.guard.reached("QmSilent")
        exchange, rounds = await open_round(parts)
        parts.gate.note_due(True)
        while not parts.transport.sent:
            await asyncio.sleep(0.01)
        rounds.cancel()  # the node stops: its tasks are cancelled, then it shuts down
        await asyncio.gather(rounds, return_exceptions=True)
        await exchange.withdraw_abandoned()
        await exchange.withdraw_abandoned()  # once is enough
        return parts.transport.sent

    assert run(scenario()) == [("QmSilent", "propose", 0), ("QmSilent", "withdraw", 0)]


@pytest.mark.parametrize("header", [
    {"kind": "withdraw", "spec": "other-run", "round": 0},
    {"kind": "leave", "spec": None, "round": 0},
    {"kind": "withdraw", "spec": None, "round": -1},
    {"kind": "withdraw", "spec": None, "round": True},
    {"kind": "propose", "spec": None, "round": "3"},
])
def test_a_malformed_pairing_request_is_a_protocol_fault(header):
    raw = encode_frame({**header, "spec": header["spec"] or SPEC.spec_hash()})
    with pytest.raises(ProtocolError):
        check_pair_request(raw, SPEC.spec_hash())

    async def scenario():
        parts = stage_at_step(30)
        return decode_frame(await parts.exchange().handle_propose("QmOdd", raw))[0]

    assert run(scenario())["error"] == "protocol"

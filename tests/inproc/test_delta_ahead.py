"""A pair's payloads move Delta first (ALGORITHM.md 3.1, Delta ahead of phi): the
partner's Delta, once in and checked, moves our inner steps before its phi arrives.
Only the partner we reserved ourselves for can move them; a poisoned Delta bans its
sender and moves nothing; a phi without its Delta is a fault; and however the round
ends, it ends where it would have without the early Delta."""

import asyncio

import pytest
import torch
import vclock
from parts import OUR_ANSWER, StageParts, partner_payload, payload_of

from swarm_node.data.spec import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import decode_frame

SPEC = RunSpec(run_id="delta-ahead", outer_codec="fp16", model_size="debug", num_stages=2, seq_len=16,
               batch_size=4, samples_per_step=4, data=DataSpec(kind="synthetic"),
               method=default_method("noloco", inner_steps=50),
               inner=InnerHyper(lr=3e-3, warmup_steps=1, total_steps=100))


def trained_worker(seed: int) -> StageWorker:
    worker = StageWorker(SPEC, 1, 16)
    g = torch.Generator().manual_seed(seed)
    for _ in range(5):
        worker.forward_backward_last(torch.randn(4, 16, worker.model_config.hidden_size, generator=g),
                                     torch.randint(0, 16, (4, 16), generator=g))
        worker.step()
    return worker


def at_boundary(seed: int = 0) -> tuple[StageParts, object]:
    """A node whose overlapped round is open, as run_round leaves it."""
    stage = StageParts(SPEC, trained_worker(seed))
    exchange = stage.exchange()
    stage.worker.open_round(overlapped=True)
    exchange.check.note_own_delta(stage.worker.own_payload()[1])
    return stage, exchange


def theta(stage: StageParts) -> list[torch.Tensor]:
    return [p.detach().clone() for p in stage.worker.params]


async def send_parts(exchange, remote: str, frames: list[bytes], reserve: bool = True):
    """The partner's frames into our handler, one after the other, with our pairing
    reserved for it (or not); returns our answers, theta after each, and the pair made."""
    pairing = exchange.pairing
    round_task = asyncio.create_task(pairing.run_round(0, OUR_ANSWER, candidates=list, propose=None,
                                                       send=None, expect_request=True))
    answers, thetas = [], []
    try:
        await pairing.seeking.wait()
        if reserve:
            pairing.on_propose(remote)
        for frame in frames:
            answers.append(decode_frame(await exchange.payloads.handle_outer(remote, frame))[0])
            thetas.append([p.detach().clone() for p in exchange.state.params])
        await asyncio.sleep(0)
        return answers, thetas, round_task.result() if round_task.done() else None
    finally:
        round_task.cancel()
        await asyncio.gather(round_task, return_exceptions=True)


def test_the_partners_delta_moves_our_steps_before_its_phi_and_the_round_ends_where_it_would_have():
    stage, exchange = at_boundary()
    start = theta(stage)
    phi, delta = payload_of(trained_worker(1), torch.float16)
    frames = partner_payload(SPEC, phi, delta)
    answers, thetas, pair = vclock.run(send_parts(exchange, "QmPartner", [frames["delta"], frames["phi"]]))
    assert all(a["ok"] for a in answers) and pair is not None and pair.partner == "QmPartner"
    assert stage.worker.open.delta_landed
    moved = max(float((a - b).abs().max()) for a, b in zip(thetas[0], start))
    assert moved > 1e-4  # the Delta alone moved theta, before the phi came
    assert all(torch.equal(a, b) for a, b in zip(thetas[0], stage.worker.open.theta_start))  # no steps since
    stage.worker.close_round([pair.payload])
    # a twin that got the whole payload at once ends at the same weights
    twin, _ = at_boundary()
    twin.worker.close_round([([p.float() for p in phi], [d.float() for d in delta])])
    assert max(float((a - b).abs().max()) for a, b in zip(theta(stage), theta(twin))) < 1e-5


def test_a_partner_lost_after_its_delta_leaves_the_local_only_step():
    stage, exchange = at_boundary()
    phi, delta = payload_of(trained_worker(1), torch.float16)
    vclock.run(send_parts(exchange, "QmPartner", [partner_payload(SPEC, phi, delta)["delta"]]))
    assert stage.worker.open.delta_landed
    stage.worker.close_round([])
    twin, _ = at_boundary()
    twin.worker.close_round([])
    assert max(float((a - b).abs().max()) for a, b in zip(theta(stage), theta(twin))) < 1e-5


def test_only_the_reserved_partners_delta_moves_our_steps_and_a_poisoned_one_bans_it():
    stage, exchange = at_boundary()
    start = theta(stage)
    phi, delta = payload_of(trained_worker(1), torch.float16)

    async def both():
        stranger = await send_parts(exchange, "QmStranger", [partner_payload(SPEC, phi, delta)["delta"]],
                                    reserve=False)
        poisoned = await send_parts(exchange, "QmPoisoner",
                                    [partner_payload(SPEC, phi, [d * 1000 for d in delta])["delta"]])
        return stranger[0], poisoned[0]

    stranger, poisoned = vclock.run(both())
    assert stranger == [{"v": 1, "ok": False, "error": "no-reservation"}]
    assert stage.guard.faults("QmStranger") == 0 and not stage.guard.is_banned("QmStranger")
    assert poisoned[0]["error"] == "protocol" and stage.guard.is_poisoned("QmPoisoner")
    assert not stage.worker.open.delta_landed and all(torch.equal(a, b) for a, b in zip(theta(stage), start))


def test_a_phi_without_its_delta_is_a_fault_and_pairs_nobody():
    stage, exchange = at_boundary()
    phi, delta = payload_of(trained_worker(1), torch.float16)
    answers, _, pair = vclock.run(send_parts(exchange, "QmSkipper", [partner_payload(SPEC, phi,
                                                                                     delta)["phi"]]))
    assert answers[0]["error"] == "protocol" and pair is None
    assert stage.guard.faults("QmSkipper") == 1


def test_a_phi_that_finds_our_round_ended_meanwhile_is_refused_not_a_fault():
    """We stopped while its phi was being decoded: the round's end dropped its Delta. The
    partner did nothing wrong (a stopping node used to log it as a bad peer)."""
    stage, exchange = at_boundary()
    phi, delta = payload_of(trained_worker(1), torch.float16)
    frames = partner_payload(SPEC, phi, delta)
    payloads, pairing = exchange.payloads, exchange.pairing
    real_take, decoding, round_ended = payloads.take, asyncio.Event(), asyncio.Event()

    async def take_while_the_round_ends(remote, request, part=None):
        checked = await real_take(remote, request, part)
        if part == "phi":
            decoding.set()
            await round_ended.wait()
        return checked

    async def scenario():
        payloads.take = take_while_the_round_ends
        round_task = asyncio.create_task(pairing.run_round(0, OUR_ANSWER, candidates=list, propose=None,
                                                           send=None, expect_request=True))
        await pairing.seeking.wait()
        pairing.on_propose("QmPartner")
        first = decode_frame(await payloads.handle_outer("QmPartner", frames["delta"]))[0]
        answering = asyncio.create_task(payloads.handle_outer("QmPartner", frames["phi"]))
        await decoding.wait()
        round_task.cancel()  # the node stops: the round ends as the exchange's does
        await asyncio.gather(round_task, return_exceptions=True)
        payloads.withdraw()
        round_ended.set()
        return first, decode_frame(await answering)[0]

    first, second = vclock.run(scenario())
    assert first["ok"] and second["error"] == "round-over"
    assert stage.guard.faults("QmPartner") == 0


@pytest.mark.parametrize("claimed_round", [0, 3])
def test_a_delta_refused_or_declined_frees_the_round_for_another_partner(claimed_round):
    """A Delta out of our scale, at our round (poisoned) or rounds ahead (declined): the
    sender's phi will not follow, so our round seeks again at once instead of holding
    the reservation for it (35 s in a node)."""
    stage, exchange = at_boundary()
    phi, delta = payload_of(trained_worker(1), torch.float16)
    big = partner_payload(SPEC, phi, [d * 1000 for d in delta], round_no=claimed_round)["delta"]
    fine = partner_payload(SPEC, phi, delta)

    async def scenario():
        pairing = exchange.payloads.pairing
        round_task = asyncio.create_task(pairing.run_round(0, OUR_ANSWER, candidates=list, propose=None,
                                                           send=None, expect_request=True))
        await pairing.seeking.wait()
        pairing.on_propose("QmBig")
        refused = decode_frame(await exchange.payloads.handle_outer("QmBig", big))[0]
        state = pairing.state.value
        pairing.on_propose("QmNext")  # not "busy": the round seeks again
        answers = [decode_frame(await exchange.payloads.handle_outer("QmNext", fine[part]))[0]
                   for part in ("delta", "phi")]
        return refused, state, answers, await round_task

    refused, state, answers, pair = vclock.run(scenario())
    assert not refused["ok"] and state == "seeking"
    assert all(a["ok"] for a in answers) and pair.partner == "QmNext"

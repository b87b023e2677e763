"""A partner whose outer update is scaled up or not finite is rejected and banned; the
node keeps accepting well-formed updates from others."""

import dataclasses
import logging
import math

import torch
import vclock
from parts import StageParts, exchange_as_partner, payload_of

from swarm_node.data.spec import DataSpec
from swarm_node.gossip.exchange import OuterExchange
from swarm_node.gossip.partner_check import distance, norm
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import decode_frame, encode_frame

# fp16 payloads: the partner's floats are what these tests shape (codecs: tests/unit/test_outer_codec.py)
SPEC = RunSpec(run_id="poison", outer_codec="fp16", model_size="debug", num_stages=2, seq_len=16,
               batch_size=4, samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=50),
               inner=InnerHyper(lr=3e-3, warmup_steps=1, total_steps=100))


def trained_worker(seed: int, steps: int = 5, spec: RunSpec = SPEC) -> StageWorker:
    worker = StageWorker(spec, 1, 16)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        worker.forward_backward_last(torch.randn(4, 16, worker.model_config.hidden_size, generator=g),
                                     torch.randint(0, 16, (4, 16), generator=g))
        worker.step()
    return worker


def request(phi, delta, spec: RunSpec = SPEC) -> bytes:
    return encode_frame({"kind": "outer", "spec": spec.spec_hash(), "round": 0, "ok": True}, [*phi, *delta])


def stage_of(worker: StageWorker, spec: RunSpec = SPEC) -> tuple[StageParts, OuterExchange]:
    stage = StageParts(spec, worker)
    return stage, stage.exchange()


def start_first_round(exchange: OuterExchange) -> None:
    """What the exchange does as our first round opens: our own Delta sets the scale."""
    exchange.check.note_own_delta(exchange.state.own_delta())


def test_scaled_up_or_nan_updates_are_rejected_and_the_sender_banned():
    stage, exchange = stage_of(trained_worker(0))
    start_first_round(exchange)
    phi, delta = payload_of(trained_worker(1))

    async def scenario():
        answers = {}
        answers["honest"] = await exchange_as_partner(exchange, "QmHonest", request(phi, delta))
        answers["x1000"] = await exchange_as_partner(exchange, "QmScaled",
                                                     request(phi, [d * 1000 for d in delta]))
        answers["nan"] = await exchange_as_partner(
            exchange, "QmNan", request(phi, [torch.full_like(d, float("nan")) for d in delta])
        )
        answers["honest again"] = await exchange_as_partner(exchange, "QmHonest", request(phi, delta))
        proposal = encode_frame({"kind": "propose", "spec": SPEC.spec_hash(), "round": 1})
        answers["scaled proposes"] = await exchange.handle_propose("QmScaled", proposal)
        answers["honest proposes"] = await exchange.handle_propose("QmHonest", proposal)
        return answers

    answers = {k: decode_frame(v)[0] for k, v in vclock.run(scenario()).items()}
    assert answers["x1000"]["error"] == "protocol" == answers["nan"]["error"]
    assert stage.guard.is_banned("QmScaled") and stage.guard.is_banned("QmNan")
    assert answers["honest"]["ok"] and answers["honest again"]["ok"]
    # a banned sender's proposals are refused too; an honest one is only told we are mid-round
    assert (
        answers["scaled proposes"]["error"] == "busy" and answers["honest proposes"]["error"] == "not-ready"
    )
    assert not stage.guard.is_banned("QmHonest")


def test_before_its_first_round_a_node_declines_a_partner_far_ahead_without_banning_it(caplog):
    """A node that started late, or is still in warm-up, sees an honest partner a round
    ahead as out of scale: it declines the exchange (the partner pairs elsewhere) and bans
    nobody. NaNs are still a fault."""
    warm = dataclasses.replace(SPEC, inner=InnerHyper(lr=3e-3, warmup_steps=100, total_steps=1000))
    stage, exchange = stage_of(trained_worker(0, steps=1, spec=warm), warm)
    phi, delta = payload_of(trained_worker(1, steps=40, spec=warm))

    async def scenario():
        ahead = await exchange_as_partner(exchange, "QmAhead", request(phi, delta, warm))
        nan = await exchange_as_partner(exchange, "QmNan",
                                        request(phi, [torch.full_like(d, float("nan")) for d in delta], warm))
        return decode_frame(ahead)[0], decode_frame(nan)[0]

    with caplog.at_level(logging.INFO, logger="swarm_node.gossip.payloads"):
        ahead, nan = vclock.run(scenario())
    assert not ahead["ok"] and ahead["error"].startswith("not-ready (partner's"), ahead
    assert "declining an outer exchange before our first round" in caplog.text
    assert not stage.guard.is_banned("QmAhead") and stage.guard.faults("QmAhead") == 0
    assert nan["error"] == "protocol" and stage.guard.is_banned("QmNan")


def test_partners_right_on_top_of_us_do_not_shrink_the_scale_honest_partners_are_held_to():
    """At round 0 every replica's phi is the same init, so partners' distances are ~0. They
    must not become the reference: a partner a round ahead later is honest, not poison."""
    stage, exchange = stage_of(trained_worker(0))
    start_first_round(exchange)
    own_phi = [p + 1e-6 for p in payload_of(stage.worker)[0]]  # as after an fp16 round trip
    _, delta = payload_of(trained_worker(1))
    ahead = trained_worker(2, steps=10)
    ahead_phi = [p.detach().clone() for p in ahead.params]  # phi one round of progress away

    async def scenario():
        for peer in ("QmA", "QmB", "QmC", "QmD"):
            await exchange_as_partner(exchange, peer, request(own_phi, delta))
        return await exchange_as_partner(exchange, "QmAhead", request(ahead_phi, delta))

    answer = decode_frame(vclock.run(scenario()))[0]
    assert answer.get("error") != "protocol" and not stage.guard.is_banned("QmAhead")


def test_what_a_partner_out_of_scale_costs_depends_on_its_round():
    """A Delta far out of our scale at our round is poison: off for half an hour, not a
    donor either. At another round it is declined and nobody is banned: one round ahead
    in warm-up an honest partner's learning rate is higher. A phi far from ours is no
    proof (honest replicas that trained apart are far apart): it counts clipped, and
    only two or more rounds ahead is it declined and we catch up. (Two stage-1 nodes
    started seconds apart: one trained alone for rounds, the other's screen counted its
    phi as poison, and the stage split for good.)"""
    stage, exchange = stage_of(trained_worker(0))
    start_first_round(exchange)
    scale = exchange.check.reference()
    phi, delta = payload_of(trained_worker(1))
    far = [p + 1.0 for p in phi]  # far from ours
    big = [d * 10 for d in delta]  # a Delta far out of our scale

    def at_round(round_no, phi, delta):
        return encode_frame(
            {"kind": "outer", "spec": SPEC.spec_hash(), "round": round_no, "ok": True}, [*phi, *delta]
        )

    cases = {"QmBigNext": (1, phi, big), "QmBigPoison": (0, phi, big), "QmFarSame": (0, far, delta),
             "QmFarNext": (1, far, delta), "QmFarAhead": (5, far, delta)}

    async def scenario():
        answers, behind = {}, {}
        for peer, (round_no, p, d) in cases.items():
            answers[peer] = decode_frame(await exchange_as_partner(exchange, peer,
                                                                   at_round(round_no, p, d)))[0]
            behind[peer] = exchange.behind
        return answers, behind

    answers, behind = vclock.run(scenario())
    guard = stage.guard
    assert answers["QmBigPoison"]["error"] == "protocol" and guard.banned_for_s("QmBigPoison") > 29 * 60
    assert guard.is_poisoned("QmBigPoison")
    assert answers["QmBigNext"]["error"].startswith("rounds-apart (partner's Delta norm")
    assert answers["QmFarAhead"]["error"].startswith("rounds-apart (partner's phi")
    assert answers["QmFarSame"]["ok"] and answers["QmFarNext"]["ok"]  # counted, clipped
    for peer in ("QmBigNext", "QmFarSame", "QmFarNext", "QmFarAhead"):
        assert not guard.is_banned(peer) and not guard.is_poisoned(peer) and guard.faults(peer) == 0, peer
    assert behind == {"QmBigNext": False, "QmBigPoison": False, "QmFarSame": False, "QmFarNext": False,
                      "QmFarAhead": True}
    # what a far phi counts as: the point 1.5x our scale on the way to it
    taken_phi, _ = exchange.check.check([*far, *delta], stage.worker.own_phi(), stage.worker.own_delta)
    assert abs(distance(taken_phi, stage.worker.own_phi()) - 1.5 * scale) < 1e-3 * scale


def test_a_peer_declined_round_after_round_is_backed_off_but_stays_a_donor():
    """Claiming another round dodges the poison check (the update is only declined),
    but a peer declined three times in a row is backed off so it cannot keep taking our
    rounds; it is not marked poisoned, so a node behind may still download from it."""
    stage, exchange = stage_of(trained_worker(0))
    start_first_round(exchange)
    phi, delta = payload_of(trained_worker(1))
    big = encode_frame({"kind": "outer", "spec": SPEC.spec_hash(), "round": 1, "ok": True},
                       [*phi, *[d * 10 for d in delta]])
    honest = encode_frame({"kind": "outer", "spec": SPEC.spec_hash(), "round": 0, "ok": True}, [*phi, *delta])

    async def scenario():
        banned = []
        for frame in (big, big, honest, big, big, big):  # an accepted exchange resets the count
            await exchange_as_partner(exchange, "QmLiar", frame)
            banned.append(stage.guard.is_banned("QmLiar"))
        return banned

    assert vclock.run(scenario()) == [False, False, False, False, False, True]
    assert not stage.guard.is_poisoned("QmLiar") and stage.guard.faults("QmLiar") == 0


WARMING = dataclasses.replace(SPEC, method=default_method("noloco", inner_steps=25),
                              inner=InnerHyper(lr=3e-3, warmup_steps=60, total_steps=1500))


def test_a_partner_is_held_to_our_scale_for_the_steps_its_delta_covers():
    """In warm-up a peer that took its round at half of it (behind us in steps) sends a
    Delta of 12 steps at lower learning rates than our 25: 5x of it, added to every
    element, was 1.8x our whole round's Delta norm and counted (clipped). Its payload
    says the steps its Delta covers, and we hold it to our scale for those: it is
    poison; an honest peer of the same steps is not."""
    ours = trained_worker(0, steps=25, spec=WARMING)
    stage, exchange = stage_of(ours, WARMING)
    opened = ours.open_round(overlapped=False)
    assert opened.steps == (0, 25)
    exchange.payloads.note_own_delta(opened.fraction, opened.steps)
    phi, delta = payload_of(trained_worker(1, steps=12, spec=WARMING))
    numel = sum(d.numel() for d in delta)
    offset = 5 * norm(delta) / math.sqrt(numel)

    def frame(delta, steps):
        header = {"kind": "outer", "spec": WARMING.spec_hash(), "round": 0, "ok": True, "steps": steps}
        return encode_frame(header, [*phi, *delta])

    async def scenario():
        shifted = [d + offset for d in delta]
        shifter = await exchange_as_partner(exchange, "QmShifter", frame(shifted, [0, 12]))
        honest = await exchange_as_partner(exchange, "QmHonest", frame(delta, [0, 12]))
        return decode_frame(shifter)[0], decode_frame(honest)[0]

    shifter, honest = vclock.run(scenario())
    assert shifter.get("error") == "protocol" and stage.guard.is_poisoned("QmShifter"), shifter
    assert honest["ok"] and not stage.guard.is_banned("QmHonest")


def test_steps_that_are_no_step_numbers_are_a_fault():
    stage, exchange = stage_of(trained_worker(0, spec=WARMING), WARMING)
    start_first_round(exchange)
    phi, delta = payload_of(trained_worker(1, spec=WARMING))
    frames = {peer: encode_frame({"kind": "outer", "spec": WARMING.spec_hash(), "round": 0, "ok": True,
                                  "steps": steps}, [*phi, *delta])
              for peer, steps in (("QmBackwards", [12, 0]), ("QmText", ["0", "12"]), ("QmOne", [12]))}

    async def scenario():
        return {peer: decode_frame(await exchange_as_partner(exchange, peer, frame))[0]
                for peer, frame in frames.items()}

    for peer, answer in vclock.run(scenario()).items():
        assert answer["error"] == "protocol" and stage.guard.faults(peer) == 1, (peer, answer)

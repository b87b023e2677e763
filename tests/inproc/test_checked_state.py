"""A joiner adopts a downloaded state only when the stage's other replicas vouch for it
(state/check.py): a hostile donor asked first (--state-from) is refused, kept off as a
poisoner and logged once, and the joiner takes an honest donor's state; donors are
picked at random, not by what their records claim."""

import logging
import random

import torch
import vclock
from parts import StageParts, record

from swarm_node.errors import PeerError
from swarm_node.net import protocols
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import encode_frame

SPEC = RunSpec(run_id="checked", model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=4)
STEP, ROUND = 500, 25


def replica(base: StageWorker, seed: int, scale: float = 1.0) -> StageParts:
    """A replica of stage 1 at step STEP: the base's phi apart by an honest spread,
    a round's momentum and some progress (times ``scale``: a hostile donor's 1.5)."""
    gen = torch.Generator().manual_seed(seed)
    worker = StageWorker(SPEC, 1, 16)
    for p, q, phi, m in zip(worker.params, base.params, worker.slow.phi, worker.slow.momentum):
        m.copy_(torch.randn(q.shape, generator=gen) * 1e-3)
        phi.copy_((q.detach() + torch.randn(q.shape, generator=gen) * 5e-4) * scale)
        p.data.copy_(phi + torch.randn(q.shape, generator=gen) * 5e-4)
    worker.inner.step_count, worker.outer_round, worker.last_round_step = STEP, ROUND, STEP - 2
    return StageParts(SPEC, worker)


class Stage:
    """Peers of stage 1 answering status, state and sketch requests in process."""

    def __init__(self, peers: dict[str, StageParts], *, silent: tuple[str, ...] = ()):
        self.syncs = {p: parts.state_sync() for p, parts in peers.items()}
        self.witnesses = {p: parts.witnesses() for p, parts in peers.items()}
        self.silent = silent  # exist, serve state, but never answer a sketch request
        self.asked: list[tuple[str, str]] = []

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
        self.asked.append((peer, protocol))
        if protocol == protocols.STATE:
            return await self.syncs[peer].handle("QmJoiner", payload)
        if protocol == protocols.STATE_SKETCH:
            if peer in self.silent:
                raise PeerError("timed out")
            return await self.witnesses[peer].handle("QmJoiner", payload)
        return encode_frame({"kind": "status", "ok": True})


def joiner(stage: Stage, peers: dict[str, StageParts], **options) -> StageParts:
    parts = StageParts(SPEC, StageWorker(SPEC, 1, 16), transport=stage)
    parts.membership.peers = {1: {p: record(1, SPEC, inner_step=STEP) for p in peers}}
    parts.sync = parts.state_sync(**options)
    return parts


def test_a_hostile_donor_asked_first_is_refused_and_an_honest_one_adopted(caplog):
    base = StageWorker(SPEC, 1, 16)
    peers = {"QmHonestA": replica(base, 1), "QmHonestB": replica(base, 2), "QmHostile": replica(base, 3, scale=1.5)}
    stage = Stage(peers)
    node = joiner(stage, peers, prefer="QmHostile")
    with caplog.at_level(logging.INFO, logger="swarm_node"):
        assert vclock.run(node.sync.download())
    assert next(p for p, proto in stage.asked if proto == protocols.STATE) == "QmHostile"
    assert node.stats.states_refused == 1 and node.guard.is_poisoned("QmHostile")
    assert node.stats.downloaded_from in ("QmHonestA", "QmHonestB") and node.worker.inner_step == STEP
    assert torch.equal(node.worker.slow.phi[0], peers[node.stats.downloaded_from].worker.slow.phi[0])
    refusals = [r for r in caplog.records if "rejected its state" in r.getMessage()]
    assert len(refusals) == 1 and "QmHostile"[-6:] in refusals[0].getMessage()
    assert "agree" in node.stats.state_check


def test_a_donor_serving_moments_no_adam_makes_is_kept_off_and_an_honest_one_adopted(caplog):
    """The Adam moments come with the state and no witness sketches them: moments forged
    to make the joiner's steps large (|exp_avg| far above sqrt(C exp_avg_sq)) are refused
    on arrival, the donor kept off as a poisoner; the honest donor's moments are adopted."""
    base = StageWorker(SPEC, 1, 16)
    peers = {"QmHonestA": replica(base, 1), "QmHonestB": replica(base, 2), "QmHostile": replica(base, 3)}
    for parts in peers.values():  # moments of a few real steps
        for _ in range(3):
            for p in parts.worker.params:
                p.grad = torch.randn_like(p) * 1e-3
            parts.worker.inner.step()
        parts.worker.inner.step_count = STEP
    hostile = peers["QmHostile"].worker
    for state in hostile.inner.state.values():
        state["exp_avg"].fill_(1.0)  # a full-size step in every coordinate, whatever the gradient
        state["exp_avg_sq"].fill_(1e-12)
    stage = Stage(peers)
    node = joiner(stage, peers, prefer="QmHostile")
    with caplog.at_level(logging.INFO, logger="swarm_node"):
        assert vclock.run(node.sync.download())
    assert node.stats.states_refused == 1 and node.guard.is_poisoned("QmHostile")
    donor = peers[node.stats.downloaded_from].worker
    assert node.stats.downloaded_from in ("QmHonestA", "QmHonestB")
    assert all(torch.equal(node.worker.inner.state[i]["exp_avg"], donor.inner.state[i]["exp_avg"])
               for i in donor.inner.state)
    refusals = [r.getMessage() for r in caplog.records if "rejected its state" in r.getMessage()]
    assert len(refusals) == 1 and "no Adam makes" in refusals[0]


def test_donors_are_picked_at_random_not_by_their_claims():
    base = StageWorker(SPEC, 1, 16)
    peers = {f"QmHonest{i}": replica(base, i) for i in range(4)}
    firsts = set()
    for seed in range(12):
        stage = Stage(peers)
        node = joiner(stage, peers, rng=random.Random(seed))
        node.membership.peers[1]["QmHonest0"] = record(1, SPEC, inner_step=10**6)  # claims the most
        assert vclock.run(node.sync.download())
        firsts.add(next(p for p, proto in stage.asked if proto == protocols.STATE))
    assert len(firsts) >= 3


def test_the_only_peer_of_the_stage_is_adopted_with_one_line(caplog):
    base = StageWorker(SPEC, 1, 16)
    peers = {"QmOnly": replica(base, 1)}
    node = joiner(Stage(peers), peers)
    with caplog.at_level(logging.WARNING, logger="swarm_node"):
        assert vclock.run(node.sync.download())
    assert node.stats.downloaded_from == "QmOnly"
    lines = [r.getMessage() for r in caplog.records if "not checked" in r.getMessage()]
    assert len(lines) == 1 and "only live peer of stage 1" in lines[0]


def test_a_state_nobody_answers_for_is_not_adopted_nor_its_donor_punished():
    base = StageWorker(SPEC, 1, 16)
    peers = {"QmDonorA": replica(base, 1), "QmDonorB": replica(base, 2)}
    stage = Stage(peers, silent=("QmDonorA", "QmDonorB"))
    node = joiner(stage, peers)
    assert not vclock.run(node.sync.download())
    assert node.worker.inner_step == 0 and node.stats.states_refused == 0
    assert not node.guard.is_poisoned("QmDonorA") and not node.guard.is_poisoned("QmDonorB")
    assert "answered" in node.stats.state_check

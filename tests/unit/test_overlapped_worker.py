"""The overlapped outer round in a node's worker (ALGORITHM.md section 3.1): what a
round sends is taken at the boundary, inner steps go on, and the outer step lands on
the weights with the progress made meanwhile carried over. With no step in between it
is the blocking round exactly."""

import pytest
import torch

from swarm_node.data.spec import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.optim.outer import outer_update
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker

H = 4
SPEC = RunSpec(model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=H),
               inner=InnerHyper(lr=3e-3, warmup_steps=1, total_steps=100))
VOCAB = 16


def train(worker: StageWorker, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        worker.forward_backward_last(torch.randn(4, 16, worker.model_config.hidden_size, generator=g),
                                     torch.randint(0, VOCAB, (4, 16), generator=g))
        worker.step()


@pytest.mark.parametrize("codec", ["fp16", "near4-3"])
def test_with_no_step_in_between_the_overlapped_round_is_the_blocking_round(codec):
    spec = RunSpec(**{**SPEC.__dict__, "outer_codec": codec})
    blocking, overlapped = StageWorker(spec, 1, VOCAB), StageWorker(spec, 1, VOCAB)
    for worker, overlap in ((blocking, False), (overlapped, True)):
        train(worker, H, seed=0)
        worker.open_round(overlapped=overlap)
        worker.close_round([])
    assert blocking.theta_digest() == overlapped.theta_digest()
    assert blocking.outer_round == overlapped.outer_round == 1


def test_steps_taken_during_the_exchange_are_carried_onto_the_new_weights():
    worker = StageWorker(SPEC, 1, VOCAB)
    train(worker, H, seed=0)
    assert worker.outer_round_due()
    opened = worker.open_round(overlapped=True)
    assert not worker.outer_round_due() and worker.ready_to_step() is False  # steps go on: the round is taken
    sent_phi, sent_delta = worker.own_payload()
    phi_before, momentum_before = (
        [t.clone() for t in worker.slow.phi],
        [t.clone() for t in worker.slow.momentum],
    )
    train(worker, 2, seed=1)
    progress = [p.detach().float() - s for p, s in zip(worker.params, opened.theta_start)]
    assert any(t.abs().max() > 0 for t in progress)
    partner = ([t + 1e-3 for t in sent_phi], [t * 0.5 for t in sent_delta])
    worker.close_round([partner])

    h = SPEC.method.outer
    new_phi, _ = outer_update(phi_before, momentum_before, [sent_phi, partner[0]], [sent_delta, partner[1]],
                              alpha=h.alpha, beta=h.beta, gamma=h.gamma)
    for p, f, moved in zip(worker.params, new_phi, progress):
        torch.testing.assert_close(p.detach().float(), f + moved, rtol=0, atol=1e-6)
    assert worker.outer_round == 1 and worker.open is None
    train(worker, H - 2 - 1, seed=2)
    assert not worker.outer_round_due()
    train(worker, 1, seed=3)
    assert worker.outer_round_due()  # a round's steps after the boundary the last one was taken at


def test_a_checkpoint_keeps_what_earlier_rounds_could_not_send(tmp_path):
    spec = RunSpec(**{**SPEC.__dict__, "outer_codec": "near4-3"})
    worker = StageWorker(spec, 1, VOCAB)
    train(worker, H, seed=0)
    worker.open_round()
    worker.close_round([])
    tensors, meta = worker.checkpoint_state()
    restored = StageWorker(spec, 1, VOCAB)
    restored.load_checkpoint_state(tensors, meta)
    for worker_ in (worker, restored):
        train(worker_, H, seed=1)
    sent, resent = worker.open_round().wire, restored.open_round().wire
    assert len(sent) == len(resent) and all(t.equal(u) for t, u in zip(sent, resent))


def test_a_snapshot_taken_during_an_overlapped_round_is_the_local_outer_steps_state():
    """theta goes on from the local outer step while phi is still the last round's: the
    snapshot a joiner gets holds the phi and momentum of that step and counts the round
    done, so the joiner's first Delta is the progress since the round opened, not an
    outer step more (before: 4-7x its partners' Delta, refused as poisoned). Closed
    alone, the donor lands exactly where the joiner stands."""
    donor, joiner = StageWorker(SPEC, 1, VOCAB), StageWorker(SPEC, 1, VOCAB)
    train(donor, H, seed=0)
    opened = donor.open_round(overlapped=True)
    train(donor, 2, seed=1)
    since_open = _norm([p.detach().float() - s for p, s in zip(donor.params, opened.theta_start)])
    snap = donor.snapshot()
    joiner.load_snapshot(snap["inner_step"], snap["outer_round"], snap["tensors"], snap["last_round_step"])
    donor.close_round([])  # the local-only step: what the snapshot stood for
    assert joiner.outer_round == donor.outer_round == 1
    assert _norm(joiner.slow.deltas()) == pytest.approx(since_open, rel=1e-5) and since_open > 0
    for a, b in zip(joiner.slow.phi + joiner.slow.momentum, donor.slow.phi + donor.slow.momentum):
        torch.testing.assert_close(a, b)
    assert joiner.theta_digest() == donor.theta_digest()

def _norm(tensors) -> float:
    return sum(float(t.float().norm() ** 2) for t in tensors) ** 0.5

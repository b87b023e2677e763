"""A poisoning peer in a NoLoCo stage, screened by the node's own PartnerCheck (the
attacker and the screening are in tests/sim/poisoning.py). A constant offset of 5x the
honest Delta norm on every element of phi and Delta used to be accepted in 42 of 43
exchanges, until the two honest nodes of the stage rejected each other."""

import pytest
import torch
from poisoning import AttackedSimulator, honest_val_loss

from swarm_node.data import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.sim import SimConfig


def config(steps: int) -> SimConfig:
    return SimConfig(method=default_method("noloco", inner_steps=10),
                     inner=InnerHyper(lr=3e-3, warmup_steps=10, total_steps=steps),
                     data=DataSpec(kind="synthetic", order=1, num_tokens=200_000), replicas=4, stages=2,
                     seq_len=32,
                     batch_size=8, steps=steps, eval_every_steps=steps, eval_batches=4)


# The attacks inside the bound need the long run to show they cannot pull the honest
# nodes apart; the one refused at once shows it in half of it.
LONG, SHORT = config(300), config(150)
ATTACKER = 3  # of stage 1


def run(config: SimConfig, **attack):
    torch.manual_seed(0)
    sim = AttackedSimulator(config, stage=1, **attack)
    sim.run()
    return sim.report, honest_val_loss(sim, 1, skip=ATTACKER if attack.get("attacker") is not None else None)


def undisturbed_run(config: SimConfig) -> float:
    report, loss = run(config, attacker=None)
    assert report.honest_rejections == 0 and report.honest_pairs > 0
    return loss


@pytest.fixture(scope="module")
def undisturbed_short():
    return undisturbed_run(SHORT)


@pytest.fixture(scope="module")
def undisturbed():
    return undisturbed_run(LONG)


def check_defended(config, report, loss, undisturbed, max_accepted):
    assert report.accepted_attacks <= max_accepted, report
    assert report.honest_rejections == 0, report  # honest nodes keep pairing with each other
    assert report.honest_pairs >= 0.9 * (config.steps // 10) * 2, report
    assert abs(loss - undisturbed) <= 0.02 * undisturbed, (loss, undisturbed)


def test_a_5x_constant_offset_is_refused_at_once_and_costs_the_honest_nodes_nothing(undisturbed_short):
    report, loss = run(SHORT, attacker=ATTACKER, scale=5.0)
    check_defended(SHORT, report, loss, undisturbed_short, max_accepted=2)
    assert report.rejected_attacks >= 1


@pytest.mark.slow
@pytest.mark.parametrize("attack,max_accepted", [(dict(scale=2.0), None), (dict(scale=10.0), 0),
                                                 (dict(scale=0.5, growth=0.3), None),
                                                 (dict(scale=0.5, growth=0.1), None)],
                         ids=["2x", "10x", "growing", "creeping"])
def test_other_attackers_are_refused_or_clipped(undisturbed, attack, max_accepted):
    """Inside the bound (2x, or an offset growing by 0.3x or 0.1x a round) an attacker
    is accepted but clipped to 1.5x our own Delta norm: it cannot pull the honest nodes
    apart, and their loss stays within 2% of an undisturbed run."""
    report, loss = run(LONG, attacker=ATTACKER, **attack)
    check_defended(LONG, report, loss, undisturbed,
                   max_accepted=max_accepted if max_accepted is not None else 10**6)

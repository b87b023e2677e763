"""gossip/partner_check.py's rounds-apart rule: a partner far ahead judges us in its own
scale, so the one behind must judge the distance in that scale too, or it averages with
partners that decline it and never catches up."""

import math
import random

import pytest
import torch

from swarm_node.gossip.partner_check import PartnerCheck, Poisoned, RoundsApart, norm
from swarm_node.optim.inner import InnerHyper, lr_at


def check_with(own_delta_norm: float, partner_delta_norm: float, phi_distance: float, rounds_ahead: int):
    check = PartnerCheck(max_update_ratio=3.0)
    own_phi = [torch.zeros(4)]
    check.note_own_delta([torch.tensor([own_delta_norm, 0.0, 0.0, 0.0])])
    delta = [torch.tensor([0.0, partner_delta_norm, 0.0, 0.0])]
    phi = [torch.tensor([0.0, 0.0, phi_distance, 0.0])]
    return check.check(phi + delta, own_phi, lambda: own_phi, rounds_ahead)


@pytest.mark.parametrize("rounds_ahead", [2, 5, 60])
def test_behind_a_partner_that_is_far_in_its_own_scale_we_decline_and_catch_up(rounds_ahead):
    """8 from us: 4x our Delta norm (2), within the 6x we allow, but 8x the partner's (1)."""
    with pytest.raises(RoundsApart) as caught:
        check_with(own_delta_norm=2.0, partner_delta_norm=1.0, phi_distance=8.0, rounds_ahead=rounds_ahead)
    assert caught.value.rounds_ahead == rounds_ahead and "its Delta norm" in str(caught.value)


@pytest.mark.parametrize("rounds_ahead", [0, 1, -2, -60])
def test_a_partner_at_our_round_or_behind_is_judged_in_our_scale(rounds_ahead):
    phi, delta = check_with(own_delta_norm=2.0, partner_delta_norm=1.0, phi_distance=8.0,
                            rounds_ahead=rounds_ahead)
    assert float(phi[0].norm()) == pytest.approx(1.5 * 2.0)  # pulled in to 1.5x our scale on the way
    assert float(delta[0].norm()) == pytest.approx(1.0)


def test_a_partner_ahead_with_a_larger_delta_is_still_judged_in_our_scale():
    check_with(own_delta_norm=2.0, partner_delta_norm=4.0, phi_distance=8.0, rounds_ahead=5)  # 4x ours: kept
    with pytest.raises(RoundsApart, match="our Delta norm"):
        check_with(own_delta_norm=2.0, partner_delta_norm=4.0, phi_distance=13.0, rounds_ahead=5)


# -- a peer that adds 5x its own Delta norm to every element it sends ----------------------
# Honest Deltas as a model: every inner step moves each element by that step's learning
# rate, up or down at random (Adam's steps are about lr an element, and their signs
# wander: in a 2 x 3 debug swarm a round taken at 0.5-0.9 of its steps had sqrt(fraction)
# of a whole round's Delta norm). The schedule is that swarm's: debug's lr, 60 steps of
# warm-up, cosine over 1500 steps, 25 a round.
H = 25
HYPER = InnerHyper(lr=3e-3, warmup_steps=60, total_steps=1500)
ROUNDS = 60


class Schedule:
    round_steps = H

    def learning_rate(self, step: int) -> float:
        return lr_at(step, HYPER)


def walk(steps: tuple[int, int], seed: int, n: int = 4096) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rates = torch.tensor([lr_at(step, HYPER) for step in range(*steps)])
    signs = torch.randint(0, 2, (steps[1] - steps[0], n), generator=g).float() * 2 - 1
    return [(rates[:, None] * signs).sum(0)]


def shifted(delta: list[torch.Tensor], scale: float = 5.0) -> list[torch.Tensor]:
    """A constant on every element, its norm ``scale`` times the Delta's."""
    offset = scale * norm(delta) / math.sqrt(sum(t.numel() for t in delta))
    return [t + offset for t in delta]


def rounds(seed: int, early: bool):
    """(our steps, the partner's steps) of each round. ``early``: 4 rounds in 10, ours and
    the partner's apart, are taken early (12-24 steps), and in the first 4 rounds the
    partner's steps lag ours by up to half a round, as a peer that started late."""
    rng = random.Random(seed)
    ours = theirs = 0
    for r in range(ROUNDS):
        k, k_partner = (H if not early or rng.random() < 0.6 else rng.randint(12, 24) for _ in range(2))
        lag = rng.randint(0, 12) if early and r < 4 else 0
        yield (ours, ours + k), (max(0, theirs - lag), max(0, theirs - lag) + k_partner)
        ours, theirs = ours + k, theirs + k_partner


def met_each_round(partner, early: bool, seed: int = 0) -> str:
    """Our check over the whole schedule, meeting ``partner`` at our round every round:
    '.' where its Delta counted, 'P' where it was refused as poisoned. With rounds taken
    early, the partner says which steps its Delta covers (as a node's payload does)."""
    check = PartnerCheck(max_update_ratio=3.0, **({"schedule": Schedule()} if early else {}))
    phi = [torch.zeros(4096)]
    seen = ""
    for r, (ours, theirs) in enumerate(rounds(seed, early)):
        own = walk(ours, seed=1000 + r)
        check.note_own_delta(own, (ours[1] - ours[0]) / H, *([ours] if early else []))
        claim = [theirs] if early else []
        try:
            check.check_delta(partner(walk(theirs, seed=r)), phi, lambda own=own: own, 0, *claim)
            seen += "."
        except Poisoned:
            seen += "P"
    return seen


def test_a_shifter_at_our_round_is_refused_all_through_the_schedule_whole_rounds():
    """Rounds of 25 steps, the shifter's too. Our scale is our Delta now: with 32 rounds'
    median as the scale the shifter got in every round from the 34th on, as the learning
    rate decays that median lags our Delta (2.9x by the 51st round), and 5x the
    shifter's Delta was under 3x of it."""
    assert met_each_round(shifted, early=False) == "P" * ROUNDS
    assert met_each_round(lambda delta: delta, early=False) == "." * ROUNDS  # honest partners: never refused


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_shifter_at_our_round_is_refused_all_through_the_schedule_rounds_taken_early(seed):
    """Rounds taken early, ours and the shifter's, and the shifter behind in steps in
    warm-up: its Delta covers fewer steps, at lower learning rates, than our scale
    (ours stretched to a whole round), and 5x of it could be under 3x of our scale
    (before the 33rd round, with the scale of 32 rounds and no steps counted, it got in
    4, 2 and 0 times). It is held to our scale for the steps it says its Delta covers."""
    assert met_each_round(shifted, early=True, seed=seed) == "P" * ROUNDS
    assert met_each_round(lambda delta: delta, early=True, seed=seed) == "." * ROUNDS


def test_claimed_steps_never_widen_the_scale():
    """A partner that claims its Delta covers a round at the schedule's peak learning
    rate, or a thousand rounds, while ours decays, is held to our scale now."""
    check = PartnerCheck(max_update_ratio=3.0, schedule=Schedule())
    for r in range(50):
        check.note_own_delta(walk((r * H, r * H + H), seed=r), 1.0, (r * H, r * H + H))
    now = check.reference()
    assert check.reference((60, 60 + H)) == now and check.reference((0, 10**11)) <= now
    assert check.reference((1200, 1200 + H // 2)) < 0.8 * now  # half a round's steps: a smaller scale

"""gossip/partner_check.py's rounds-apart rule: a partner far ahead judges us in its own
scale, so the one behind must judge the distance in that scale too, or it averages with
partners that decline it and never catches up."""

import pytest
import torch

from swarm_node.gossip.partner_check import PartnerCheck, RoundsApart


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
    phi, delta = check_with(own_delta_norm=2.0, partner_delta_norm=1.0, phi_distance=8.0, rounds_ahead=rounds_ahead)
    assert float(phi[0].norm()) == pytest.approx(1.5 * 2.0)  # pulled in to 1.5x our scale on the way
    assert float(delta[0].norm()) == pytest.approx(1.0)


def test_a_partner_ahead_with_a_larger_delta_is_still_judged_in_our_scale():
    check_with(own_delta_norm=2.0, partner_delta_norm=4.0, phi_distance=8.0, rounds_ahead=5)  # 4x ours: kept
    with pytest.raises(RoundsApart, match="our Delta norm"):
        check_with(own_delta_norm=2.0, partner_delta_norm=4.0, phi_distance=13.0, rounds_ahead=5)

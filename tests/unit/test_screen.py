import math

import pytest

from swarm_node.train.screen import MagnitudeScreen


def test_values_far_above_the_recent_median_are_rejected_and_not_learned():
    screen = MagnitudeScreen(max_ratio=10)
    for value in (1.0, 1.2, 0.8):
        assert screen.check(value, "norm") is None
    assert screen.reference() == 1.0
    problem = screen.check(1000.0, "norm")
    assert problem is not None and "1000x the recent median 1" in problem
    assert screen.reference() == 1.0  # a rejected value does not move the reference
    assert screen.check(9.0, "norm") is None
    assert screen.check(math.nan, "norm") == "norm is not finite"


def test_the_reference_follows_a_gradual_change():
    screen = MagnitudeScreen(max_ratio=10, window=8)
    value = 1.0
    for _ in range(100):
        value *= 1.5
        assert screen.check(value, "norm") is None


def test_no_reference_means_no_rejection_and_bad_ratios_are_refused():
    assert MagnitudeScreen(max_ratio=3, min_history=2).check(1e9, "x") is None
    with pytest.raises(ValueError):
        MagnitudeScreen(max_ratio=1)

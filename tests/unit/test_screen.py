import math

import pytest

from swarm_node.train.screen import MagnitudeScreen


def test_a_spike_far_above_the_recent_median_is_rejected():
    screen = MagnitudeScreen(max_ratio=10)
    for value in (1.0, 1.2, 0.8):
        assert screen.check(value, "norm") is None
    assert screen.reference() == 1.0
    problem = screen.check(1000.0, "norm")
    assert problem is not None and "1000x the recent median 1" in problem
    assert screen.reference() == 1.1  # one value of the window: the median barely moves
    assert screen.check(9.0, "norm") is None
    assert screen.check(math.nan, "norm") == "norm is not finite"
    assert screen.reference() == 1.2  # a non-finite value is not learned


def test_a_sustained_jump_is_followed_once_it_fills_half_the_window():
    """Honest activations grew 100-200x within seconds early in a real run; a reference
    fed only accepted values stayed behind and refused an honest peer for good."""
    screen = MagnitudeScreen(max_ratio=100, window=8)
    for _ in range(8):
        assert screen.check(0.2, "rms") is None
    refused = 0
    for _ in range(20):
        refused += screen.check(40.0, "rms") is not None
    assert refused == 4  # until the new scale holds half the window


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

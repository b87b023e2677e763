"""Where a node's training time ends (compute utilisation's clock, obs/stats.py)."""

from swarm_node.obs.stats import training_until


def test_the_clock_ends_at_the_last_step_when_the_last_round_opens_right_there():
    assert training_until(last_step_at=100.0, last_round_opened_at=100.01, now=130.0) == 100.01
    assert training_until(last_step_at=100.0, last_round_opened_at=80.0, now=130.0) == 100.0  # opened mid-run


def test_a_wait_for_a_round_still_under_way_after_the_last_step_counts_as_any_boundarys_does():
    """The steps ended at 100 and stood until the round before ended at 106: that wait
    counts (it would, moved ahead of the steps); the last round's own exchange does not."""
    assert training_until(last_step_at=100.0, last_round_opened_at=106.0, now=120.0) == 106.0


def test_a_node_that_never_stepped_counts_to_now():
    assert training_until(last_step_at=None, last_round_opened_at=None, now=7.0) == 7.0

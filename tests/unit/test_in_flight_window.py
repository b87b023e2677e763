"""Stage 0's window of micro-batches in flight (routing/window.py): Little's law from the
measured compute and wait, the least recent wait, and its bounds."""

import pytest

from swarm_node.routing.window import MIN_WINDOW, RECENT, InFlightWindow


def test_unmeasured_it_starts_small():
    assert InFlightWindow(8).size(next_stage_accepts=64) == MIN_WINDOW


def test_a_wait_long_against_the_compute_deepens_the_window():
    window = InFlightWindow(16)
    for _ in range(5):
        window.note(compute_s=0.010, wait_s=0.070)  # a GPU stage: 10 ms compute, 70 ms out
    assert window.size(64) == 9  # (10 + 70) / 10 + 1


def test_a_cpu_stage_keeps_a_shallow_window():
    window = InFlightWindow(16)
    for _ in range(5):
        window.note(compute_s=0.200, wait_s=0.150)
    assert window.size(64) == 3


def test_the_least_recent_wait_counts_not_a_queue_that_grows_behind_it():
    window = InFlightWindow(16)
    for wait_s in (0.03, 0.3, 0.6, 0.9):  # the next stage queues what we send: waits grow
        window.note(compute_s=0.010, wait_s=wait_s)
    assert window.size(64) == 5


def test_old_measurements_leave_the_window():
    window = InFlightWindow(64)
    window.note(compute_s=0.010, wait_s=0.0)
    for _ in range(RECENT):
        window.note(compute_s=0.010, wait_s=0.100)
    assert window.size(1000) == 12


@pytest.mark.parametrize("accepts, cap, expected", [(64, 4, 4), (3, 16, 3), (0, 16, 1)])
def test_bounded_by_the_cap_and_what_the_next_stage_accepts(accepts, cap, expected):
    window = InFlightWindow(cap)
    window.note(compute_s=0.001, wait_s=1.0)
    assert window.size(accepts) == expected


def test_nonsense_is_not_noted_and_a_zero_cap_refused():
    window = InFlightWindow(8)
    window.note(compute_s=0.0, wait_s=1.0)
    window.note(compute_s=0.1, wait_s=-1.0)
    assert window.size(64) == MIN_WINDOW
    with pytest.raises(ValueError):
        InFlightWindow(0)

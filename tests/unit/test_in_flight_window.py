"""Stage 0's window of micro-batches in flight (routing/window.py): Little's law from the
measured compute and wait, the least recent wait, and its bounds."""

import pytest

from swarm_node.routing.window import MIN_WINDOW, PACE_SAMPLES, RECENT, InFlightWindow


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


def test_a_link_bound_stage_keeps_no_more_in_flight_than_its_link_moves():
    """8 s out (1 MB each way at 2 Mbit/s), 10 ms of compute: compute alone would keep the
    cap out, all queued behind each other on the link. One comes back every 4 s (the
    uplink's pace): the bandwidth-delay product is 2, and one more probes for more."""
    window = InFlightWindow(64)
    for _ in range(5):
        window.note(compute_s=0.010, wait_s=8.0)
    assert window.size(64) == 64  # unmeasured link: compute's window
    marks = [window.sent(0.0) for _ in range(3)]  # three out at once, back 4 s apart
    for i, mark in enumerate(marks):
        window.delivered(mark, 8.0 + 4.0 * i)
    assert window.link_rate() == pytest.approx(3 / 16.0)  # the last: 3 back while it was out 16 s
    assert window.size(64) == 3  # ceil(3/16 * 8.01) + 1


def test_a_compute_bound_stage_keeps_its_compute_window():
    window = InFlightWindow(16)
    for _ in range(5):
        window.note(compute_s=0.200, wait_s=0.150)
    marks = [window.sent(0.0) for _ in range(3)]
    for i, mark in enumerate(marks):
        window.delivered(mark, 0.35 + 0.2 * i)  # back at the compute's pace
    assert window.size(64) == 3


def test_a_hop_deadline_stretches_with_the_link_not_with_a_stall():
    window = InFlightWindow(16)
    assert window.deadline_s(2, floor_s=30.0, cap_s=300.0) == 180.0  # unmeasured: 3x the floor for each out
    assert window.deadline_s(30, floor_s=30.0, cap_s=300.0) == 300.0
    window.delivered(window.sent(0.0), 8.0)  # one micro-batch in 8 s
    assert window.deadline_s(4, floor_s=30.0, cap_s=300.0) == pytest.approx(96.0)  # 3 x 4 x 8 s
    assert window.deadline_s(1, floor_s=30.0, cap_s=300.0) == 30.0  # never under the floor
    assert window.deadline_s(20, floor_s=30.0, cap_s=300.0) == 300.0  # nor over the cap
    fast = InFlightWindow(16)
    fast.delivered(fast.sent(0.0), 0.05)
    assert fast.deadline_s(8, floor_s=30.0, cap_s=300.0) == 30.0  # a fast link: a stall is the floor


@pytest.mark.parametrize("compute_s, back_every_s, expected", [
    (0.2, 4.0, 0.05),  # a CPU stage on a 2 Mbit/s link: a twentieth of its compute's pace
    (0.2, 0.2, 1.0),  # compute-bound: back at the compute's pace
])
def test_the_paced_share_is_what_comes_back_over_what_we_compute(compute_s, back_every_s, expected):
    window = InFlightWindow(16)
    marks = []
    for i in range(PACE_SAMPLES):
        assert window.paced_share() is None  # not yet measured
        window.note(compute_s=compute_s, wait_s=1.0)
        if i:  # one out at a time, back ``back_every_s`` after it went
            window.delivered(marks[-1], i * back_every_s)
        marks.append(window.sent(i * back_every_s))
    window.delivered(marks[-1], PACE_SAMPLES * back_every_s)
    assert window.paced_share() == pytest.approx(expected)

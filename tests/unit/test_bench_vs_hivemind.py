"""The bookkeeping of bench.vs_hivemind: swarm curves, the common target, time to
target and counter interpolation, on hand-made numbers."""

import pytest

from bench.common.curves import CurvePoint, Point, common_target, swarm_curve, time_to_target, value_at


def test_swarm_curve_averages_peers_and_waits_for_the_last():
    points = [Point(0, 50, 10.0, 3.0), Point(1, 40, 12.0, 2.0), Point(0, 100, 20.0, 1.5)]
    curve = swarm_curve(points, num_peers=2, steps_per_sync=50)
    assert curve == [CurvePoint(45, 12.0, 2.5, 2)]  # an early round joins its sync; 100 lacks peer 1


def test_swarm_curve_keeps_the_latest_snapshot_of_a_sync():
    points = [Point(0, 50, 10.0, 3.0), Point(0, 50, 11.0, 2.9), Point(1, 50, 10.5, 3.1)]
    assert swarm_curve(points, num_peers=2, steps_per_sync=50) == [CurvePoint(50, 11.0, 3.0, 2)]


def test_snapshots_of_peers_stopped_between_synchronisations_make_a_last_point():
    points = [Point(0, 50, 10.0, 3.0), Point(1, 50, 10.5, 3.2), Point(0, 63, 170.0, 2.8),
              Point(1, 65, 171.0, 2.9)]
    curve = swarm_curve(points, num_peers=2, steps_per_sync=50)
    assert [(c.step, c.time_s, c.peers) for c in curve] == [(50, 10.5, 2), (64, 171.0, 2)]
    assert [c.val_loss for c in curve] == pytest.approx([3.1, 2.85])


def test_a_snapshot_that_names_its_round_joins_that_round_wherever_its_step_lies():
    """An overlapped round's checkpoint comes when the exchange lands, 30 steps past the
    boundary here; read off the step it would fall between two rounds, and every
    point but the last was lost."""
    points = [Point(0, 80, 10.0, 3.0, sync=1), Point(1, 79, 10.5, 3.2, sync=1),
              Point(0, 130, 17.0, 2.8, sync=2), Point(1, 131, 17.5, 2.6, sync=2)]
    curve = swarm_curve(points, num_peers=2, steps_per_sync=50)
    assert [(c.step, c.time_s, c.peers) for c in curve] == [(79.5, 10.5, 2), (130.5, 17.5, 2)]
    assert [c.val_loss for c in curve] == pytest.approx([3.1, 2.7])


def test_common_target_is_a_little_above_the_worst_final():
    assert common_target([2.1, 2.3449], initial=5.3449) == pytest.approx(2.65)  # 2.3449 + 0.1 * 3.0 = 2.6449
    assert common_target([2.3, 2.2], initial=2.3) == pytest.approx(2.30)


def test_time_to_target_interpolates_between_points():
    curve = [CurvePoint(0, 0.0, 5.0, 2), CurvePoint(50, 10.0, 3.0, 2), CurvePoint(100, 20.0, 2.0, 2)]
    assert time_to_target(curve, 2.5) == pytest.approx(15.0)
    assert time_to_target(curve, 5.0) == 0.0
    assert time_to_target(curve, 1.0) is None


def test_value_at_interpolates_and_clamps():
    samples = [(1.0, 100.0), (3.0, 300.0)]
    assert value_at(samples, 2.0) == pytest.approx(200.0)
    assert value_at(samples, 0.0) == 100.0
    assert value_at(samples, 9.0) == 300.0
    assert value_at([], 1.0) is None

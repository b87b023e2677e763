"""The latency model's analytic limits, its input parsing, and a tiny end-to-end run (well under 2 s)."""

import json
import math

import numpy as np
import pytest

from bench.common.latency import (
    Variant,
    allreduce_to_pair_ratio,
    barrier_run_times,
    binomial_tree_paths,
    level_barrier_paths,
    pair_exchange_mean,
    random_pairs,
    slowest_pair_paths,
    tree_paths,
)
from bench.latency_model import benchmark as latency_model
from bench.latency_model.inputs import largest_per_setting, small_n_ratios, summary_times


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.mark.parametrize("n", [2, 4, 64, 1024])
def test_equal_message_times_give_2_log2_n_against_2(rng, n):
    assert np.all(tree_paths(rng, n, 0.0, 3) == 2 * math.log2(n))
    ratio = allreduce_to_pair_ratio(rng, n, 0.0, 3)
    assert ratio["ratio"] == math.log2(n) and ratio["pair_t"] == 2.0 and ratio["stderr"] == 0.0
    for variant in (binomial_tree_paths, level_barrier_paths):
        assert np.all(variant(rng, n, 0.0, 2) == 2 * math.log2(n))
    assert np.all(slowest_pair_paths(rng, n, 0.0, 2) == 2.0)


def test_spread_makes_the_tree_slower_than_log2_n_and_the_pair_mean_is_exact(rng):
    assert allreduce_to_pair_ratio(rng, 64, 1.0, 300)["ratio"] > 6.5
    pair = tree_paths(rng, 2, 1.0, 40_000).mean()
    assert pair == pytest.approx(pair_exchange_mean(1.0), rel=0.02)
    assert pair_exchange_mean(0.0, mean=0.3) == pytest.approx(0.6)
    with pytest.raises(ValueError):
        tree_paths(rng, 6, 0.0, 1)


def test_random_pairs_is_a_perfect_matching(rng):
    first, second = random_pairs(rng, 3, 16)
    assert first.shape == (3, 8)
    for row in np.concatenate([first, second], axis=1):
        assert sorted(row) == list(range(16))


def test_no_step_spread_means_no_barrier_idle_time(rng):
    variants = [Variant(10), Variant(20), Variant(20, (0.5, 0.0))]
    plain_10, plain_20, talking = barrier_run_times(rng, 16, variants, 1.0, 0.0, 200, 2)
    assert plain_10["ratio"] == 1.0 and plain_20["ratio"] == 1.0
    assert plain_10["rounds"] == 20 and plain_20["rounds"] == 10
    # equal message times: a round is H steps plus 2 log2(N) messages (DiLoCo) or 2 (NoLoCo)
    assert talking["diloco_s"] == pytest.approx(10 * (20 * math.e + 8 * 0.5))
    assert talking["noloco_s"] == pytest.approx(10 * (20 * math.e + 2 * 0.5))


def test_step_spread_costs_the_global_barrier_more(rng):
    (run,) = barrier_run_times(rng, 16, [Variant(10)], 1.0, math.sqrt(0.5), 300, 4)
    assert run["ratio"] > 1.0


SYNC_COST = {"mode": "quick", "started": "t0",
             "summary": {"message_time_s": {"loopback": {"1000000": 0.05, "10000000": 0.4},
                                            "tbf_200mbit": {"1000000": 0.2, "x": "?"}},
                         "allreduce_over_pair": {"loopback": {"1000000": {"2": 1.2, "4": 1.9}}}}}
SWARM = {"mode": "quick", "started": "t0", "summary": {"step_time_s": {"mean": 0.3, "std": 0.06, "n": 9,
                                                                       "layout": "2x2"}}}


def test_measured_inputs_are_read_without_inventing_a_spread():
    messages = summary_times(SYNC_COST, "message_time_s")
    assert messages == {("loopback", "1000000"): (0.05, None), ("loopback", "10000000"): (0.4, None),
                        ("tbf_200mbit", "1000000"): (0.2, None)}
    assert largest_per_setting(messages) == {("loopback", "10000000"): (0.4, None),
                                             ("tbf_200mbit", "1000000"): (0.2, None)}
    assert summary_times({"summary": {"t": [1.0, 3.0]}}, "t") == {(): (2.0, math.sqrt(2))}
    assert summary_times(None, "message_time_s") == {}
    assert small_n_ratios(SYNC_COST) == [{"label": "loopback / 1000000", "n_peers": 2, "measured": 1.2},
                                         {"label": "loopback / 1000000", "n_peers": 4, "measured": 1.9}]
    assert latency_model.read_step_times(SWARM) == {"2x2 swarm": (0.3, 0.06)}


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(latency_model.BUDGETS, "quick", {"tree": 4, "variants": 2, "workers": 4})
    monkeypatch.setattr(latency_model, "RUN_INNER_STEPS", 100)


def _rendered(result) -> str:
    return latency_model.markdown({"mode": result.mode, "rows": result.rows, "summary": result.summary,
                                   "notes": result.notes})


def test_a_tiny_run_without_measured_inputs_says_so(tiny, tmp_path):
    result = latency_model.run("quick", tmp_path)
    assert result.summary["allreduce_ratio_at_1024"]["N = 1024, std/t = 0"] == 10.0
    text = _rendered(result)
    assert "sync_cost.json is absent" in text and "swarm_efficiency.json is absent" in text
    assert "latency_model.png" in text and "| N = 1024, std/t = 0 | 10.00 | 10 | +0.0% |" in text


def test_a_tiny_run_with_measured_inputs_projects_them(tiny, tmp_path):
    (tmp_path / "sync_cost.json").write_text(json.dumps(SYNC_COST))
    (tmp_path / "swarm_efficiency.json").write_text(json.dumps(SWARM))
    result = latency_model.run("quick", tmp_path)
    measured = [r for r in result.rows if r["table"] == "measured_messages"]
    assert {r["cv_source"] for r in measured} == {"assumed"} and len(measured) == 3 * 5
    assert set(result.summary["measured_round_ratio"]) == {
        f"{setting}, N = {n}, H = 100" for setting in ("loopback / 10000000", "tbf_200mbit / 1000000")
        for n in (16, 1024)}
    text = _rendered(result)
    assert "2x2 swarm" in text and "tbf_200mbit / 1000000" in text

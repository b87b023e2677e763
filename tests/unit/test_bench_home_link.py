"""bench.home_link's plan and its reading of a run, without the test bed: both methods'
rounds among the same volunteers, and what the convergence benchmark's wall-clock model
takes from them."""

from __future__ import annotations

import pytest

from bench.convergence.wallclock import link_from_home_link, step_cost
from bench.home_link import benchmark as home_link
from bench.home_link.plan import FULL, METHOD_VOLUNTEERS, QUICK, method_scenario, run_spec, scenarios


def _row(method: str, rounds_s: list[float], utilisation: list[float]) -> dict:
    return {"scenario": method_scenario(method), "method": method, "volunteers": METHOD_VOLUNTEERS,
            "step_s": 0.5, "compute_utilisation": utilisation, "held_s_per_round": [1.0] * len(rounds_s),
            "critical_path_s": [{"round": r, "exchange": r - 2.0} for r in rounds_s],
            "bytes_per_partner_round": [3_000_000 if method == "noloco" else 9_000_000] * len(rounds_s)}


def test_both_methods_run_among_the_same_volunteers_in_either_mode():
    for plan in (QUICK, FULL):
        ran = {s.method: s for s in scenarios(plan is FULL) if s.volunteers == METHOD_VOLUNTEERS}
        assert set(ran) == {"noloco", "diloco"} and ran["noloco"].codec == ran["diloco"].codec
        assert run_spec(plan, ran["diloco"].codec, method="diloco").method.name == "diloco"


def test_a_methods_round_as_run_is_what_the_wall_clock_model_charges():
    rows = [_row("noloco", [10.0, 12.0], [0.96, 0.94]), _row("diloco", [22.0, 24.0], [0.93, 0.91])]
    rounds = {m: home_link.round_as_run(r, inner_steps=50) for m, r in zip(("noloco", "diloco"), rows)}
    assert rounds["noloco"]["round_s"] == 11.0 and rounds["noloco"]["utilisation"] == 0.94  # the slowest node
    assert rounds["diloco"]["inner_phase_s"] == 25.0 and rounds["diloco"]["volunteers"] == METHOD_VOLUNTEERS
    # the link's step is a volunteer's of the main scenarios: 0.25 s, so DiLoCo's round is 92 steps
    link = link_from_home_link({"payload_s_fp16": 10.0, "volunteer_step_s": 0.25,
                                "rounds_as_run_here": rounds})
    assert step_cost("diloco", 4, 10, link, as_run_here=True) == pytest.approx(23.0 / 0.25 / 10)
    assert step_cost("noloco", 8, 10, link, as_run_here=True) == pytest.approx(11.0 / 0.25 / 10)
    text = "\n".join(home_link._rounds_as_run(rounds))
    assert "| DiLoCo (every peer of the stage) | 23.0 s | 25.0 s | 9.00 MB | 1.0 s | 91% |" in text
    assert home_link._rounds_as_run({}) == []  # a result from before these scenarios renders without them

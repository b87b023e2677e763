"""bench.state_check on a small swarm: honest states pass, the hostile donor's do not,
and its section renders."""

import random

from bench.common.results import Result
from bench.state_check.benchmark import Swarm, measure_swarm
from bench.state_check.report import markdown


def test_a_small_swarm_refuses_only_the_hostile_states(tmp_path):
    result = Result("state_check", "quick", tmp_path)
    measure_swarm(Swarm(2, 3), result, random.Random(0))
    by_case = {row["case"]: row for row in result.rows}
    assert by_case["honest"]["refused"] == 0 and by_case["honest"]["checked"] >= 60
    for case in ("scaled by 1.5", "one tensor replaced", "20 rounds old", "another run's"):
        assert by_case[case]["refused"] == by_case[case]["checked"] > 0, case
    section = markdown({"rows": result.rows, "summary": result.summary, "notes": [], "mode": "quick",
                        "wall_s": 1.0})
    assert "| 2 x 2, H = 3, noloco | 0 / " in section

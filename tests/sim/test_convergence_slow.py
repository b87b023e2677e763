"""The acceptance runs of the foundation issue: 4 replicas x 2 stages, debug model,
synthetic data, 1000 inner steps per method (about a minute each on 2 cores)."""

import json

import pytest

from swarm_node.cli.main import main

# The module fixture runs all four methods inside the first test's setup (~6 minutes).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for method in ("ddp", "noloco", "diloco", "local"):
        path = tmp_path_factory.mktemp(method) / "out.json"
        assert main(["sim", "--method", method, "--replicas", "4", "--stages", "2", "--model", "debug",
                     "--data", "synthetic", "--steps", "1000", "--threads", "2", "--json-out", str(path),
                     "--no-progress"]) == 0
        out[method] = json.loads(path.read_text())
    return out


def test_ddp_gets_close_to_the_entropy_floor(runs):
    ddp = runs["ddp"]
    initial = ddp["val_loss_curve"][0][1]
    assert (ddp["final_val_loss"] - ddp["entropy_floor"]) < 0.2 * (initial - ddp["entropy_floor"])


def test_noloco_matches_ddp_and_beats_local(runs):
    assert runs["noloco"]["final_val_loss"] < 1.05 * runs["ddp"]["final_val_loss"]
    assert runs["noloco"]["final_val_loss"] < runs["local"]["final_val_loss"]


def test_equal_tokens_and_time_budget(runs):
    assert len({r["tokens"] for r in runs.values()}) == 1
    assert all(r["wall_s"] < 180 for r in runs.values())

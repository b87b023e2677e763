"""The simulator end to end on small problems (seconds each)."""

import dataclasses
import json

import pytest
import torch

from swarm_node.cli.main import main
from swarm_node.data import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.sim import SimConfig, Simulator

# Order 1 needs no attention to learn, so a couple of hundred steps get close to the floor.
SYNTHETIC = DataSpec(kind="synthetic", order=1, num_tokens=100_000)


def small_config(method: str, steps: int = 200, **overrides) -> SimConfig:
    inner_steps = overrides.pop("inner_steps", 20)
    base = dict(method=default_method(method, inner_steps=inner_steps),
                inner=InnerHyper(lr=3e-3, warmup_steps=10, total_steps=steps), data=SYNTHETIC, replicas=2,
                stages=2, seq_len=32, batch_size=8, steps=steps, eval_every_steps=steps // 4, eval_batches=4)
    base.update(overrides)
    return SimConfig(**base)


@pytest.fixture(scope="module")
def results():
    return {m: Simulator(small_config(m)).run() for m in ("noloco", "diloco", "ddp", "local")}


@pytest.mark.parametrize("method", ["noloco", "diloco", "ddp", "local"])
def test_every_method_drives_loss_towards_the_entropy_floor(results, method):
    r = results[method]
    initial = r.val_loss_curve[0][1]
    assert r.entropy_floor is not None and initial > r.entropy_floor
    excess = (r.final_val_loss - r.entropy_floor) / (initial - r.entropy_floor)
    assert excess < 0.5, f"{method}: excess loss still {excess:.0%} of its initial value"
    assert r.tokens == 200 * 2 * 8 * 32


def test_ddp_replicas_stay_identical(results):
    assert results["ddp"].replica_weight_std == [0.0, 0.0]


def test_averaging_shrinks_the_spread_of_replicas(results):
    for stage in range(2):
        assert results["noloco"].replica_weight_std[stage] < results["local"].replica_weight_std[stage]
        assert results["diloco"].replica_weight_std[stage] < results["local"].replica_weight_std[stage]


def test_diloco_outer_round_leaves_every_worker_on_the_same_weights():
    sim = Simulator(small_config("diloco", steps=20, replicas=3, inner_steps=20))
    for _ in range(20):
        sim.train_step()
    assert min(sim.replica_weight_std()) > 0
    sim.outer_round()
    assert sim.replica_weight_std() == [0.0, 0.0]


def test_noloco_pair_round_with_odd_count_runs_and_pulls_together():
    sim = Simulator(small_config("noloco", steps=10, replicas=3))
    for _ in range(10):
        sim.train_step()
    before = sim.replica_weight_std()
    sim.outer_round()
    after = sim.replica_weight_std()
    assert all(a < b for a, b in zip(after, before))


def test_random_routing_sends_micro_batches_to_different_workers():
    sim = Simulator(small_config("local", steps=1, replicas=4))
    seen = {tuple(sim._paths()[1]) for _ in range(20)}
    assert len(seen) > 1 and all(sorted(p) == [0, 1, 2, 3] for p in seen)
    fixed = Simulator(small_config("local", steps=1, replicas=4, routing="fixed"))
    assert fixed._paths()[1] == [0, 1, 2, 3]


def test_runs_are_reproducible_for_a_seed():
    a = Simulator(small_config("noloco", steps=30, inner_steps=10)).run()
    b = Simulator(small_config("noloco", steps=30, inner_steps=10)).run()
    assert a.final_val_loss == b.final_val_loss and a.train_loss_curve == b.train_loss_curve


def test_fp16_activations_still_train():
    r = Simulator(small_config("noloco", steps=60, activation_codec="fp16")).run()
    assert r.final_val_loss < r.val_loss_curve[0][1] - 0.1


def test_single_stage_single_replica():
    r = Simulator(small_config("noloco", steps=20, replicas=1, stages=1)).run()
    assert r.replica_weight_std == [0.0] and torch.isfinite(torch.tensor(r.final_val_loss))


def test_cli_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "out.json", tmp_path / "loss.png"
    code = main(["sim", "--method", "noloco", "--replicas", "2", "--stages", "2", "--model", "debug",
                 "--data", "synthetic:tokens=50000", "--seq-len", "16", "--batch-size", "4", "--steps", "20",
                 "--inner-steps", "10", "--json-out", str(out), "--plot", str(png), "--no-progress"])
    assert code == 0
    data = json.loads(out.read_text())
    for key in ("method", "final_val_loss", "val_loss_curve", "train_loss_curve", "replica_weight_std",
                "tokens", "wall_s", "entropy_floor"):
        assert key in data, key
    assert data["method"] == "noloco" and data["tokens"] == 20 * 2 * 4 * 16
    assert len(data["replica_weight_std"]) == 2 and data["outer_rounds"] == 2
    assert all(len(point) == 2 for point in data["val_loss_curve"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reports_bad_settings_in_one_line(capsys):
    code = main(["sim", "--model", "enormous", "--steps", "1", "--no-progress"])
    assert code == 2
    assert "unknown model size" in capsys.readouterr().err


def test_config_refuses_a_split_the_model_cannot_take_before_loading_anything():
    from swarm_node.errors import ConfigError

    with pytest.raises(ConfigError,
                       match="the debug model has 2 layers, which cannot be split into 3 stages: "
                                          "use stages 2 or fewer"):
        small_config("noloco", stages=3)
    assert small_config("noloco", stages=3, layers_per_stage=(0, 1, 1)).stages == 3


def test_random_paths_evaluate_the_paths_a_swarm_routes():
    """Before training every worker of a stage is the same model, so any path is the fixed
    path; after it, random paths mix workers that never met on a fixed path, and the same
    seed draws the same paths."""
    sim = Simulator(small_config("local", steps=20))
    assert sim.evaluate_random_paths(seed=3) == pytest.approx(sim.evaluate(), rel=1e-6)
    for _ in range(20):
        sim.train_step()
    fixed, random_paths = sim.evaluate(), sim.evaluate_random_paths(seed=3)
    assert random_paths == sim.evaluate_random_paths(seed=3) and random_paths != fixed


def _final_weights(config: SimConfig) -> list[torch.Tensor]:
    sim = Simulator(config)
    for step in range(1, config.steps + 1):
        sim.advance(step)
    return [p.detach().clone() for workers in sim.workers for w in workers for p in w.stage.parameters()]


def test_overlapped_steps_started_from_the_blocking_step_train_as_the_blocking_round():
    """The analysis start "known" (the group's outer step, which no node knows at the
    boundary) is the blocking round with the steps reordered; the node's rule is not."""
    blocking = _final_weights(small_config("noloco", steps=40, inner_steps=10))
    known = _final_weights(small_config("noloco", steps=40, inner_steps=10, outer_latency_steps=5,
                                        overlap_start="known"))
    local = _final_weights(small_config("noloco", steps=40, inner_steps=10, outer_latency_steps=5))
    assert max(float((a - b).abs().max()) for a, b in zip(blocking, known)) < 1e-4
    assert max(float((a - b).abs().max()) for a, b in zip(blocking, local)) > 1e-3


def test_a_delta_first_landing_is_the_whole_landing_when_delta_comes_with_phi_and_not_when_ahead():
    """With the exchange one step long both parts land at that step: nothing moves
    earlier. With five steps, Delta (half of an fp32 payload) lands at step 3 and moves
    the steps from there."""
    def run(latency: int, landing: str) -> list[torch.Tensor]:
        return _final_weights(small_config("noloco", steps=40, inner_steps=10, outer_latency_steps=latency,
                                           outer_landing=landing))

    assert all(torch.equal(a, b) for a, b in zip(run(1, "whole"), run(1, "delta-first")))
    whole, first = run(5, "whole"), run(5, "delta-first")
    assert max(float((a - b).abs().max()) for a, b in zip(whole, first)) > 1e-4


def test_a_delta_sent_ahead_of_phi_lands_as_far_into_the_exchange_as_its_share_of_the_bytes():
    sim = Simulator(small_config("noloco", steps=20, inner_steps=10, outer_latency_steps=9,
                                 outer_landing="delta-first", outer_codec="near4-3"))
    # near4-3: Delta 3 bits and phi 4, each with a float32 step per 256 values: 43 % of the bytes
    assert sim._deltas_at(10) == 10 + 4  # 3.88 steps in
    assert Simulator(dataclasses.replace(sim.config, outer_codec="fp16"))._deltas_at(10) == 10 + 5  # 4.5
    assert Simulator(dataclasses.replace(sim.config, outer_latency_steps=1))._deltas_at(10) is None


def test_an_exchange_outlasting_the_round_spends_its_wait_first_so_the_delta_lands_sooner():
    """L steps of exchange against H = 10: the node waits L - 10 anyway, first, so the
    Delta (half of an fp16 payload, L / 2 in) lands L - 10 steps sooner in the round."""
    config = small_config("noloco", steps=20, inner_steps=10, outer_landing="delta-first", outer_codec="fp16")

    def deltas_at(latency: int) -> int | None:
        return Simulator(dataclasses.replace(config, outer_latency_steps=latency))._deltas_at(10)

    assert deltas_at(10) == 10 + 5  # no wait: 5 steps in, as before
    assert deltas_at(14) == 10 + 3  # 7 in, 4 of them waited first
    assert deltas_at(20) == 10  # a round waited first: in before the round's first step
    assert deltas_at(30) == 10
    whole = Simulator(dataclasses.replace(config, outer_latency_steps=20, outer_landing="whole"))
    assert whole._deltas_at(10) is None


def test_a_delta_in_before_the_rounds_steps_is_the_start_with_the_partners_delta_known():
    """Two rounds of exchange, Delta first: the steps start from the pair's Delta step,
    which is the analysis start "known-deltas" with the phi a round late."""
    def run(**kw) -> list[torch.Tensor]:
        return _final_weights(small_config("noloco", steps=40, inner_steps=10, outer_codec="fp16", **kw))

    waited_first = run(outer_latency_steps=20, outer_landing="delta-first")
    known_deltas = run(outer_latency_steps=10, overlap_start="known-deltas")
    whole = run(outer_latency_steps=20)
    assert max(float((a - b).abs().max()) for a, b in zip(waited_first, known_deltas)) < 1e-4
    assert max(float((a - b).abs().max()) for a, b in zip(waited_first, whole)) > 1e-3


def test_an_unknown_overlap_start_is_refused():
    with pytest.raises(ValueError, match="overlap_start"):
        small_config("noloco", overlap_start="guess")
    with pytest.raises(ValueError, match="outer_landing"):
        small_config("noloco", outer_landing="sideways")


def test_the_reference_codes_frozen_input_embedding_never_moves_while_the_rest_trains():
    sim = Simulator(small_config("noloco", steps=6, inner_steps=3, freeze_input_embedding=True))
    before = [w.stage.model.embed_tokens.weight.detach().clone() for w in sim.workers[0]]
    blocks = [[p.detach().clone() for p in w.stage.parameters() if p.requires_grad] for w in sim.workers[0]]
    for step in range(1, 7):
        sim.advance(step)
    for w, embedding, trained in zip(sim.workers[0], before, blocks):
        # through inner steps and outer rounds
        assert torch.equal(w.stage.model.embed_tokens.weight, embedding)
        assert any(not torch.equal(p, q) for p, q in zip([p for p in w.stage.parameters() if p.requires_grad],
                                                          trained))
    moving = Simulator(small_config("noloco", steps=2, inner_steps=3))
    start = moving.workers[0][0].stage.model.embed_tokens.weight.detach().clone()
    moving.advance(1)
    assert not torch.equal(moving.workers[0][0].stage.model.embed_tokens.weight, start)


def test_ddp_averages_around_a_frozen_embedding():
    sim = Simulator(small_config("ddp", steps=2, freeze_input_embedding=True))
    before = sim.workers[0][0].stage.model.embed_tokens.weight.detach().clone()
    sim.advance(1)
    assert torch.equal(sim.workers[0][0].stage.model.embed_tokens.weight, before)


@pytest.mark.parametrize("method", ["diloco", "noloco"])
def test_an_outer_step_of_lr_1_without_momentum_is_plain_training(method):
    """phi <- phi - 1 * (phi - theta) is theta: with beta 1, alpha 0 (and gamma 0) an
    outer round changes nothing, so one replica trains as DDP does (the inner optimizer's
    state and lr schedule carry on through the rounds). Anything a round resets or skips
    shows here; the M = 1 rows of bench.size_trend rest on it."""
    plain = small_config("ddp", steps=20, replicas=1, eval_every_steps=20)
    identity = default_method(method, inner_steps=5, alpha=0.0, beta=1.0, gamma=0.0)
    rounds = Simulator(dataclasses.replace(plain, method=identity)).run()
    assert rounds.outer_rounds == 4
    assert rounds.final_val_loss == pytest.approx(Simulator(plain).run().final_val_loss, rel=1e-5)

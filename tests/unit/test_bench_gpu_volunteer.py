"""bench.gpu_volunteer's plan and its reading of a run, without the test bed: the EMULATED
card's times from gpu_step.json (a sixth of the H200's eager rate, the last stage scaled
to the 32k head), what a micro-batch moves across the boundary in each codec, the real
stages' parameters and outer payloads, the padding that makes a stand-in's payload the
real size, and the row a run's /api/status samples make."""

from __future__ import annotations

import copy

import pytest

from bench.common.results import load
from bench.gpu_step.benchmark import flops_per_token
from bench.gpu_volunteer import benchmark as bench
from bench.gpu_volunteer import plan
from bench.gpu_volunteer.emulation import EmulatedCard
from bench.gpu_volunteer.swarm import Ran, Sample, card_line, volunteer_flags, window_closed
from swarm_node.model.stages import build_stage
from swarm_node.spec import RunSpec
from swarm_node.wire.outer_codec import outer_codec

TOKENS = plan.BATCH * plan.SEQ


def test_the_card_is_a_sixth_of_the_h200s_eager_rate_with_the_32k_head_on_the_last_stage():
    gpu_step = load("gpu_step")
    times = plan.card_times(gpu_step)
    rows = {r["stage"]: r for r in gpu_step["rows"] if r["size"] == "small" and r["stages"] == 2
            and r["mode"] == "baseline" and r["vocab"] == 256}
    assert times.vocab_measured == 256 and times.h200_step_s == (rows[0]["step_s"], rows[1]["step_s"])
    assert times.stage_s[0] == pytest.approx(6 * rows[0]["step_s"])  # the embedding is a lookup: unscaled
    spec = RunSpec(model_size="small", num_stages=2, seq_len=1024, batch_size=8, samples_per_step=8)
    head = flops_per_token(spec, 1, 32_000) / flops_per_token(spec, 1, 256)
    assert rows[1]["flops_per_token"] == flops_per_token(spec, 1, 256)
    assert head == pytest.approx(1.468, abs=1e-3)
    assert times.stage_s[1] == pytest.approx(6 * rows[1]["step_s"] * head)
    assert "EMULATED" in times.note() and "1/6" in times.note()
    # gpu_step measured at 32k: taken as it is
    at_32k = copy.deepcopy(gpu_step)
    for row in at_32k["rows"]:
        if row["size"] == "small" and row["stages"] == 2:
            row["vocab"] = 32_000
            row["flops_per_token"] = flops_per_token(spec, row["stage"], 32_000)
    measured = plan.card_times(at_32k)
    assert measured.head_scale == 1.0 and measured.stage_s[1] == pytest.approx(6 * rows[1]["step_s"])


def test_what_a_micro_batch_moves_across_the_boundary_in_each_codec():
    fp16, int8, coded = (plan.boundary_bytes(c, r) for c, r in plan.CODECS)
    hidden = 768
    assert fp16[0] / TOKENS == pytest.approx(2 * hidden + 4, abs=0.1)  # values and int32 targets
    assert fp16[1] / TOKENS == pytest.approx(2 * hidden, abs=0.1)
    assert int8[0] / TOKENS == pytest.approx(hidden * (1 + 4 / 256) + 4, abs=0.1)  # blockwise steps too
    assert max(coded) / TOKENS <= 2 * hidden / 32  # everything counts against the ratio
    assert coded[0] / TOKENS > 45  # the budget used: code, steps, 15-bit ids and the frame


def test_the_round_comes_every_60_s_of_inner_steps_at_each_codecs_pace():
    times = plan.CardTimes(stage_s=(0.2, 0.25), h200_step_s=(0.0, 0.0), vocab_measured=32_000, head_scale=1.0)
    for codec, ratio in plan.CODECS:
        pace = plan.microbatch_s(codec, ratio, times)
        assert pace == max(0.25, *(plan.link_s(b) for b in plan.boundary_bytes(codec, ratio)))
        assert plan.inner_steps(codec, ratio, times) == round(60.0 / pace)
    assert plan.inner_steps("bottleneck8", 32.0, times) == 240  # card-bound: 0.25 s a micro-batch
    assert plan.inner_steps("fp16", None, times) == 12  # link-bound: 12.6 MB at 20 Mbit/s, 5 s
    assert plan.card_tokens_per_s(times) == pytest.approx(2 * TOKENS / 0.25)
    assert plan.link_tokens_per_s("fp16", None) == pytest.approx(2 * 20e6 / 8 / 1540, rel=1e-3)


def test_the_real_stages_parameters_and_their_outer_payloads():
    fp16 = plan.real_parameters("fp16", None)
    coded = plan.real_parameters("bottleneck8", 32.0)
    layer = 4 * 768 * 768 + 3 * 768 * 2048 + 2 * 768
    assert fp16 == (32_000 * 768 + 6 * layer, 6 * layer + 768 + 32_000 * 768)
    width = 45  # what 32x leaves at hidden 768 and 15-bit ids (wire/boundary.py)
    assert coded == (fp16[0] + 768 * width, fp16[1] + width * 768 + 32_000 * 768)  # encoder; decoder, anchor
    per_param = outer_codec("near4-3").bytes_per_parameter()
    assert per_param == pytest.approx(0.906, abs=1e-3)
    assert plan.outer_payload_bytes("bottleneck8", 32.0) == tuple(-(-n * per_param // 1) for n in coded)


@pytest.mark.parametrize("codec", ["fp16", "bottleneck8"])
def test_the_count_is_what_the_stages_built_hold(codec):
    """The count the plan uses against stages built for real (a small model: the same
    code builds ``small``'s)."""
    spec = RunSpec(model_size="mini", num_stages=3, seq_len=64, batch_size=8, samples_per_step=8,
                   activation_codec=codec, activation_ratio=8.0 if codec == "bottleneck8" else None)
    config, _ = spec.model(500)
    for stage in range(3):
        built = build_stage(config, num_stages=3, stage_index=stage, seed=0)
        assert plan.stage_parameter_count(config, stage, 3) == sum(p.numel() for p in built.parameters())


def test_the_stand_ins_payload_is_padded_to_the_real_stages_size():
    card = plan.card("bottleneck8", 32.0, plan.CardTimes((0.2, 0.25), (0.0, 0.0), 32_000, 1.0))
    assert card.real_params == plan.real_parameters("bottleneck8", 32.0) and card.vocab_size == 32_000
    codec = outer_codec("near4-3")
    for stage in (0, 1):
        phi_pad, delta_pad = card.padding(codec, stage, phi_bytes=10_000, delta_bytes=7_000)
        real = card.real_params[stage] * codec.bytes_per_parameter()
        assert phi_pad + 10_000 + delta_pad + 7_000 == round(real)
        assert delta_pad + 7_000 == round(real * codec.delta_share())
    assert card.padding(codec, 0, phi_bytes=10**12, delta_bytes=10**12) == (0, 0)  # never negative
    with pytest.raises(ValueError):
        EmulatedCard(stage_s=(0.2, 0.0), forward_share=0.25, vocab_size=32_000, real_params=(1, 1))


def test_the_card_card_file_round_trips_and_the_volunteers_type_the_join_line_behind_it(tmp_path):
    card = EmulatedCard(stage_s=(0.2, 0.25), forward_share=0.25, vocab_size=32_000, real_params=(5, 6))
    assert EmulatedCard.read(card.write(tmp_path / "card.json")) == card
    line = card_line("swarm-node join --initial-peers /ip4/10.201.0.10/tcp/1/p2p/Qm", tmp_path / "card.json")
    assert "-m bench.gpu_volunteer.card --card" in line and line.endswith("join --initial-peers "
                                                                          "/ip4/10.201.0.10/tcp/1/p2p/Qm")
    with pytest.raises(ValueError):
        card_line("something else", tmp_path / "card.json")
    assert volunteer_flags(2)[:2] == ["--stage", "0"] and "--data-shard" in volunteer_flags(2)
    assert volunteer_flags(3)[:2] == ["--stage", "1"] and "--data-shard" not in volunteer_flags(3)


def _stats(training_s=0, tokens=0, lost=0, rounds=0, wait_s=0.0, to_next=(0, 0, 0), from_previous=(0, 0, 0),
           local=0):
    side = lambda v: dict(zip(("sent", "received", "tokens"), v))  # noqa: E731
    return {"training_s": training_s, "tokens": tokens, "microbatches_lost": lost,
            "rounds_with_partner": rounds, "local_only_rounds": local, "link_wait_s": wait_s,
            "link_wait_share": 0.5, "to_next": side(to_next), "from_previous": side(from_previous)}


def test_a_runs_row_is_read_from_the_volunteers_counters_over_the_window():
    stages = [0, 1, 0, 1]
    first = Sample(100.0, [_stats(0, 0), _stats(0, 0), _stats(0, 0), _stats(0, 0)], [0, 0, 0, 0])
    forward = (4_000_000, 3_000_000, 80_000)
    last = Sample(200.0, [_stats(90, 8192 * 400, rounds=1, wait_s=120, to_next=forward),
                          _stats(95, 0, rounds=1, from_previous=(3_000_000, 4_000_000, 80_000)),
                          _stats(80, 8192 * 300, lost=1, wait_s=30, to_next=forward),
                          _stats(97, 0, from_previous=(3_000_000, 4_000_000, 80_000))],
                  [1_000_000, 2_000_000, 1_000_000, 2_000_000], load=3.0)
    ran = Ran(stages=stages, samples=[first, last], summaries=[{"microbatches_lost": 2}] * 4, started_s=40.0)
    times = plan.CardTimes((0.2, 0.25), (0.0, 0.0), 32_000, 1.0)
    row = bench.codec_row("bottleneck8", 32.0, 240, times, ran)
    assert row["emulated"] is True and row["name"] == "bottleneck8 at 32x" and row["window_s"] == 100.0
    assert row["stage0_tokens_per_s"] == pytest.approx(8192 * 700 / 100)
    assert row["compute_utilisation"] == [0.9, 0.95, 0.8, 0.97]
    assert row["utilisation_by_stage"] == {"0": 0.85, "1": 0.96}
    assert row["bytes_per_token_stage0"]["0-1"] == {"sent": 50.0, "received": 37.5, "tokens": 160_000}
    assert row["bytes_per_token_stage1"]["0-1"]["sent"] == 37.5
    assert row["link_wait_share"] == [1.0, 0.3]  # a wait begun before the window: at most all of it
    assert row["microbatches_lost"] == 1
    assert row["rounds_with_partner"] == [1, 1, 0, 0] and row["microbatches_lost_in_run"] == 8
    assert row["rounds_closed"] == [1, 1, 0, 0] and row["load_average"] == 1.5 and row["rate_mbit"] == 20.0
    assert row["wire_bytes_per_token"] == pytest.approx(6_000_000 / (8192 * 700), abs=0.1)
    assert row["series"] == [[100.0, 0.85, 0.96, 57344.0]]
    fp16 = dict(row, activation_codec="fp16", activation_ratio=None, name="fp16", stage0_tokens_per_s=2_000.0)
    reference = bench.codec_row("bottleneck8", 32.0, 240, times, ran, rate_mbit=None)
    assert reference["name"] == "bottleneck8 at 32x, links unshaped"
    assert reference["link_allows_tokens_per_s"] is None
    summary = bench.summary([fp16, row, dict(reference, stage0_tokens_per_s=1.0)])
    assert summary["coded_tokens_per_s_vs_fp16"] == pytest.approx(28.67, abs=0.01)
    assert summary["coded_meets_target_utilisation"] is True and summary["emulated"] is True
    text = bench.markdown({"summary": summary, "rows": [fp16, row, reference], "mode": "quick",
                           "wall_s": 600.0, "notes": ["EMULATED card"]})
    assert "EMULATED" in text and "| bottleneck8 at 32x | 240 | 57,344 |" in text and "85% / 96%" in text
    assert "| bottleneck8 at 32x, links unshaped | 240 | 57,344 | unshaped |" in text


def test_the_window_lasts_its_time_then_until_every_volunteer_closed_its_rounds_at_most_its_cap():
    at = lambda t, rounds, local=0: Sample(t, [_stats(rounds=rounds), _stats(local=local)], [0, 0])  # noqa: E731
    plan_ = plan.Plan(window_s=90.0, rounds=1, max_window_s=180.0)
    start = at(0.0, 0)
    assert not window_closed(plan_, [start, at(80.0, 1, local=1)])  # not yet its time
    assert not window_closed(plan_, [start, at(100.0, 1)])  # the second volunteer has closed none
    assert window_closed(plan_, [start, at(100.0, 1, local=1)])  # a local-only round counts
    assert window_closed(plan_, [start, at(180.0, 0)])  # the cap

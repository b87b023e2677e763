"""What a volunteer's uplink needs (swarm_node/model/links.py, docs/VOLUNTEERS.md's uplink
table): the card it assumes is the measured one, the coded boundary's weights are those a
built stage holds, the figure is the sum of its parts, and the guide's advice is what
the figures say."""

import json
from pathlib import Path

import pytest

from swarm_node.model import links
from swarm_node.model.coded import coded_model
from swarm_node.model.config import model_config
from swarm_node.model.memory import stage_parameters
from swarm_node.model.stages import build_stage

REPO = Path(__file__).resolve().parents[2]


def test_the_card_is_the_h200_s_measured_eager_rates_and_flop_count():
    rows = json.loads((REPO / "bench" / "results" / "gpu_step.json").read_text())["rows"]
    eager = [r for r in rows if r["mode"] == "baseline"]
    assert {r["size"] for r in eager if r["stages"] == 2} == set(links.H200_EAGER_TOKENS_PER_S)
    for row in eager:
        assert (row["batch_size"], row["seq_len"], row["vocab"]) == (8, links.MEASURED_SEQ,
                                                                      links.MEASURED_VOCAB)
        config = model_config(row["size"], vocab_size=row["vocab"], max_seq_len=row["seq_len"])
        assert links.stage_flops_per_token(config, num_stages=row["stages"], stage_index=row["stage"],
                                           seq_len=row["seq_len"]) == row["flops_per_token"]
        if row["stages"] == 2:
            assert links.H200_EAGER_TOKENS_PER_S[row["size"]][row["stage"]] == round(row["tokens_per_s"])


@pytest.mark.parametrize("size,stages", [("debug", 2), ("mini", 4)])
def test_a_bottleneck_s_weights_are_those_a_built_stage_holds(size, stages):
    config, _ = coded_model(model_config(size, vocab_size=300, max_seq_len=64),
                            activation_codec="bottleneck8", activation_ratio=8, batch_size=4, seq_len=64,
                            num_stages=stages)
    for s in range(stages):
        stage = build_stage(config, num_stages=stages, stage_index=s, seed=0)
        built = sum(p.numel() for p in stage.parameters())
        assert built == stage_parameters(config, num_stages=stages, stage_index=s) + sum(
            links.bottleneck_parameters(config, stages, s)), s


def test_the_uplink_is_activations_targets_gradients_and_the_round():
    """``small`` in 2 stages in fp16, by hand from gpu_step.json's figures: stage 0 sends
    activations and int32 targets, stage 1 gradients, each its round, at the pipeline's rate."""
    h, vocab, tokens = 768, 32_000, 8 * 1024
    first_flops_per_s = 226_166 * 311_427_072 / 6
    last_flops_per_s = 306_294 * 312_606_720 / 6
    last_flops = 312_606_720 + 6 * (vocab - 256) * h  # the 32k head in place of the byte vocabulary's
    tokens_per_s = min(first_flops_per_s / 311_427_072, last_flops_per_s / last_flops)
    config = model_config("small", vocab_size=vocab, max_seq_len=1024)
    first = tokens_per_s * (2 * h + 4) * 8 / 1e6 + links.round_mbit(stage_parameters(config, num_stages=2,
                                                                                       stage_index=0), 60)
    last = tokens_per_s * 2 * h * 8 / 1e6 + links.round_mbit(stage_parameters(config, num_stages=2,
                                                                             stage_index=1), 60)
    mbit, per_s = links.uplink_mbit("small", num_stages=2, codec="fp16")
    assert per_s == pytest.approx(tokens_per_s / tokens)
    assert mbit == pytest.approx(max(first, last))


def test_the_guide_s_advice_is_what_the_figures_say():
    """docs/VOLUNTEERS.md: with bottleneck8 at 32x a 20 Mbit/s uplink carries tiny in 2 or 4
    stages and small in 2 with two-minute rounds (not one-minute ones); small in 4 needs
    50; medium and large need more than 50 however split; fp16 and int8 need 71 Mbit/s
    and more."""
    def mbit(size, stages, codec="bottleneck8", phase_s=60.0):
        return links.uplink_mbit(size, num_stages=stages, codec=codec, inner_phase_s=phase_s)[0]

    assert mbit("tiny", 2) <= 10 and mbit("tiny", 4) <= 10
    assert mbit("small", 2, phase_s=120) <= 20 < mbit("small", 2) <= 50
    assert 20 < mbit("small", 4) <= 50
    assert all(mbit(size, stages, phase_s=120) > 50 for size in ("medium", "large") for stages in (2, 4))
    plain = [mbit(size, stages, codec) for size in ("tiny", "small", "medium", "large") for stages in (2, 4)
             for codec in ("fp16", "int8")]
    assert round(min(plain)) == 71 and max(plain) < 1.35e3
    guide = (REPO / "docs" / "VOLUNTEERS.md").read_text()
    assert "fp16 and int8 stages need 71 Mbit/s to 1.3 Gbit/s" in guide

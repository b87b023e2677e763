"""Blockwise codecs in the simulator (wire/blockwise.py): activations and gradients
between stages in 8 bits, and phi and Delta in the run's default outer codec, against
full precision at equal tokens."""

import dataclasses

import pytest
import torch

from swarm_node.data import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.sim import SimConfig, Simulator
from swarm_node.spec import RunSpec

STEPS = 300
CONFIG = SimConfig(method=default_method("noloco", inner_steps=10),
                   inner=InnerHyper(lr=3e-3, warmup_steps=10, total_steps=STEPS),
                   data=DataSpec(kind="synthetic", order=1, num_tokens=200_000), replicas=4, stages=2,
                   seq_len=32,
                   batch_size=8, steps=STEPS, eval_every_steps=STEPS, eval_batches=4)


def final_loss(**settings) -> float:
    torch.manual_seed(0)
    return Simulator(dataclasses.replace(CONFIG, **settings)).run().final_val_loss


def test_a_short_run_with_both_codecs_trains():
    short = dict(steps=40, inner=InnerHyper(lr=3e-3, warmup_steps=5, total_steps=40), eval_every_steps=40)
    result = Simulator(dataclasses.replace(CONFIG, activation_codec="int8", outer_codec=RunSpec().outer_codec,
                                           **short)).run()
    assert result.outer_rounds == 4 and result.final_val_loss < result.val_loss_curve[0][1] - 0.1


@pytest.mark.slow
def test_8_bit_activations_and_4_bit_delta_with_error_feedback_within_1_percent():
    plain = final_loss()
    for settings in (dict(activation_codec="int8"), dict(outer_codec=RunSpec().outer_codec),
                     dict(outer_codec="int8")):
        coded = final_loss(**settings)
        print(f"{settings}: {coded:.4f} against {plain:.4f}")
        assert abs(coded / plain - 1) <= 0.01, (settings, coded, plain)

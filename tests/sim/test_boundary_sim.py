"""Coded stage boundaries in the simulator (docs/ALGORITHM.md 9): every hop goes through
the node's wire code (wire/boundary.py), the run trains, and NoLoCo's rounds, random
routing, the consensus model and a pickled resume all work with what the codec adds
to the stages."""

import dataclasses
import pickle

import pytest
import torch

from swarm_node.data import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.sim import SimConfig, Simulator
from swarm_node.wire import boundary as coded

STEPS = 40
CONFIG = SimConfig(method=default_method("noloco", inner_steps=10),
                   inner=InnerHyper(lr=3e-3, warmup_steps=5, total_steps=STEPS),
                   data=DataSpec(kind="synthetic", order=1, num_tokens=100_000), replicas=2, stages=2,
                   seq_len=32,
                   batch_size=8, steps=STEPS, eval_every_steps=STEPS, eval_batches=2,
                   activation_codec="bottleneck8", activation_ratio=8.0)


@pytest.mark.parametrize("codec", ["bottleneck8", "subspace8"])
def test_a_coded_boundary_trains_through_the_wire_code(codec, monkeypatch):
    sim = Simulator(dataclasses.replace(CONFIG, activation_codec=codec))
    sent = []
    real = coded.forward_request
    monkeypatch.setattr(coded, "forward_request", lambda *a: sent.append(real(*a)) or sent[-1])
    result = sim.run()
    assert sim.boundary.width == 14 and sim.boundary.kind == codec[:-1]  # debug's 64 at 8x: 16 bytes a token
    assert len(sent) == STEPS * CONFIG.replicas
    assert max(len(raw) for raw in sent) <= 2 * 64 / 8 * CONFIG.batch_size * CONFIG.seq_len
    assert result.outer_rounds == STEPS // 10
    assert result.final_val_loss < result.val_loss_curve[0][1] - 0.3
    assert result.final_consensus_val_loss < result.val_loss_curve[0][1] - 0.3


def test_a_pickled_coded_run_goes_on_bit_for_bit():
    """bench/convergence/runs.py's Resumable: the whole simulator pickled mid-run."""
    config = dataclasses.replace(CONFIG, steps=12, inner=InnerHyper(lr=3e-3, warmup_steps=2, total_steps=12))
    torch.manual_seed(0)
    a = Simulator(config)
    for step in range(1, 7):
        a.advance(step)
    b = pickle.loads(pickle.dumps(a))
    losses = [(a.advance(step), b.advance(step)) for step in range(7, 13)]
    assert all(x == y for x, y in losses)
    assert all(torch.equal(p, q) for p, q in zip(a.workers[1][0].stage.parameters(),
                                                  b.workers[1][0].stage.parameters()))


def test_the_command_line_wants_a_ratio_with_a_coded_boundary_and_only_then(capsys):
    from swarm_node.cli.main import main

    assert main(["sim", "--activation-codec", "bottleneck4", "--steps", "1", "--no-progress"]) == 2
    assert main(["sim", "--activation-ratio", "32", "--steps", "1", "--no-progress"]) == 2
    assert capsys.readouterr().err.count("--activation-ratio goes with a coded boundary") == 2

"""The GPU tier: the final evaluation of `swarm-node local` on the card, in parts that fit,
gives the CPU's losses (bf16 autocast against fp32)."""

from __future__ import annotations

import threading

import pytest
import torch

from swarm_node.data.dataset import load_windows
from swarm_node.data.spec import DataSpec
from swarm_node.local.evaluation import FinalEvaluation, plan_paths, rows_that_fit
from swarm_node.model.config import model_config
from swarm_node.model.stages import build_stage
from swarm_node.spec import RunSpec
from swarm_node.train.evaluate import BatchParts, path_val_loss

pytestmark = pytest.mark.gpu

SPEC = RunSpec(run_id="eval", model_size="tiny", num_stages=2, seq_len=128,
               data=DataSpec(kind="synthetic", num_tokens=400_000))


@pytest.fixture(scope="module")
def data():
    return load_windows(SPEC.data, SPEC.seq_len)


def _weights(vocab: int) -> dict[int, dict[int, dict]]:
    config = model_config("tiny", vocab_size=vocab, max_seq_len=SPEC.seq_len)
    return {s: {r: build_stage(config, num_stages=2, stage_index=s,
                               seed=r + 1).state_dict() for r in range(2)}
            for s in range(2)}


def _run(data, device: str) -> dict:
    weights = _weights(data.vocab_size)
    evaluation = FinalEvaluation(SPEC, data, device=device, batch_size=64, max_batches=4, threads=4,
                                 progress=False,
                                 stop=threading.Event())
    return evaluation.run(weights, plan_paths(2, 2, weights, {}))


def test_the_final_evaluation_runs_on_the_card_and_gives_the_cpus_losses(data):
    on_card, on_cpu = _run(data, "cuda"), _run(data, "cpu")
    assert on_card["eval_device"] == "cuda" and on_cpu["eval_device"] == "cpu"
    for key in ("initial_val_loss", "final_val_loss", "final_consensus_val_loss"):
        assert on_card[key] == pytest.approx(on_cpu[key], rel=1e-2), key


def test_a_batch_too_big_for_the_card_goes_through_in_parts(data):
    config = model_config("tiny", vocab_size=data.vocab_size, max_seq_len=SPEC.seq_len)
    path = [build_stage(config, num_stages=2, stage_index=s, seed=1).cuda() for s in range(2)]
    assert rows_that_fit(config, SPEC.seq_len, 64, torch.device("cuda")) == 64  # tiny fits whole
    whole = path_val_loss(path, data, batch_size=64, max_batches=2, device="cuda",
                          parts=BatchParts(autocast_dtype=torch.bfloat16))
    parts = BatchParts(rows=5, autocast_dtype=torch.bfloat16)
    assert path_val_loss(path, data, batch_size=64, max_batches=2, device="cuda", parts=parts) == \
        pytest.approx(whole, rel=1e-3)

"""`swarm-node export` round trip: checkpoints of a 2-stage run (stage 1 from two peers,
averaged) become a Hugging Face Llama checkpoint that `LlamaForCausalLM` loads and that
gives the swarm model's logits. Slow tier: it needs the `hf` extra (transformers), which
`./dev.sh test-slow` installs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from swarm_node.data.spec import DataSpec
from swarm_node.export.assemble import assemble, load_model
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.state.checkpoint import save_checkpoint
from swarm_node.train.worker import StageWorker

SPEC = RunSpec(run_id="export", model_size="debug", num_stages=2, seq_len=32, batch_size=4,
               samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=10),
               inner=InnerHyper(lr=3e-3, warmup_steps=1, total_steps=100))
VOCAB = 16


def trained(stage: int, seed: int) -> StageWorker:
    """A stage trained a few steps on random inputs, so the replicas of a stage differ."""
    worker = StageWorker(SPEC, stage, VOCAB)
    g = torch.Generator().manual_seed(seed)
    hidden_size = worker.model_config.hidden_size
    for _ in range(3):
        targets = torch.randint(0, VOCAB, (4, SPEC.seq_len), generator=g)
        if stage == 0:
            tokens = torch.randint(0, VOCAB, (4, SPEC.seq_len), generator=g)
            out = worker.forward(tokens)
            worker.backward(tokens, torch.randn(out.shape, generator=g) * 1e-2)
        else:
            worker.forward_backward_last(torch.randn(4, SPEC.seq_len, hidden_size, generator=g), targets)
        worker.step()
    return worker


def write(worker: StageWorker, directory) -> None:
    tensors, meta = worker.checkpoint_state()
    meta.update(spec_hash=SPEC.spec_hash(), run_id=SPEC.run_id, peer_id=f"QmPeer{directory.name}", data=None)
    save_checkpoint(directory, worker.inner_step, tensors, meta)


@pytest.mark.slow
def test_exported_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import LlamaForCausalLM

    dirs = [tmp_path / "s0", tmp_path / "s1-a", tmp_path / "s1-b"]
    workers = [trained(stage, seed) for stage, seed in [(0, 0), (1, 1), (1, 2)]]
    for directory, worker in zip(dirs, workers):
        write(worker, directory)
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "swarm_node", "export", "--checkpoint", *map(str, dirs),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "peers averaged per stage: [1, 2]" in done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 2

    assembled = assemble(dirs)
    head = (workers[1].stage.lm_head.weight + workers[2].stage.lm_head.weight) / 2
    # stage 1: the peers' mean
    torch.testing.assert_close(assembled.state_dict["lm_head.weight"], head.detach())
    ours = load_model(assembled)
    theirs = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (2, SPEC.seq_len), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = ours(tokens)
        got = theirs(input_ids=tokens).logits
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_generate_samples_text_from_the_same_checkpoints(tmp_path):
    dirs = [tmp_path / "s0", tmp_path / "s1"]
    for directory, stage in zip(dirs, (0, 1)):
        write(trained(stage, stage), directory)
    done = subprocess.run([sys.executable, "-m", "swarm_node", "generate", "--checkpoint", *map(str, dirs),
                           "--prompt", "abc", "--max-new-tokens", "20", "--seed", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = done.stdout.strip()
    assert text.startswith("abc") and len(text) == 23 and set(text) <= set("abcdefghijklmnop")

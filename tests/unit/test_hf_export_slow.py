"""`swarm-node export` round trip: checkpoints of a 2-stage run (stage 1 from two peers,
averaged) become a Hugging Face Llama checkpoint that `LlamaForCausalLM` loads and that
gives the swarm model's logits; a bottleneck run's export loads with its modelling file
(trust_remote_code) and gives the swarm's loss, and `generate` runs on it. Slow tier: it
needs the `hf` extra (transformers), which `./dev.sh test-slow` installs."""

from __future__ import annotations

import dataclasses
import json
import os
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
                           "--out", str(out)], check=False, capture_output=True, text=True, timeout=120)
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
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = done.stdout.strip()
    assert text.startswith("abc") and len(text) == 23 and set(text) <= set("abcdefghijklmnop")


# Run in a child with Hugging Face's caches in the test's folder: trust_remote_code copies
# the modelling file into HF_MODULES_CACHE and imports it from there.
LOAD_REMOTE = """
import sys, torch
from transformers import AutoModelForCausalLM
folder, given, answer = sys.argv[1:]
try:
    AutoModelForCausalLM.from_pretrained(folder)
    refused = ""
except ValueError as exc:
    refused = str(exc)
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
data = torch.load(given)
with torch.no_grad():
    logits = model(input_ids=data["tokens"]).logits
    out = model.generate(data["prompt"], max_new_tokens=6, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
torch.save({"class": type(model).__name__, "dtype": str(logits.dtype), "refused": refused, "logits": logits,
            "sequences": out.sequences, "step_logits": torch.stack(out.logits, 1)}, answer)
"""


@pytest.mark.slow
@pytest.mark.parametrize("layers", [None, (0, 1, 1), (1, 1, 0)], ids=str)
def test_a_bottleneck_export_loads_in_transformers_with_the_swarms_loss_and_generates(tmp_path, layers):
    from tests.unit.test_export import CODED, coded_checkpoints, swarm_loss

    spec = CODED["bottleneck8"]
    if layers is not None:
        spec = dataclasses.replace(spec, run_id="export-bottleneck-3", num_stages=3, layers_per_stage=layers)
    paths, workers = coded_checkpoints(tmp_path, spec)
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "swarm_node", "export", "--checkpoint", *map(str, paths),
                           "--out", str(out)], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "with its bottleneck boundaries (load with trust_remote_code=True)" in done.stderr
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (4, 16), generator=g)
    targets = torch.randint(0, VOCAB, (4, 16), generator=g)
    torch.save({"tokens": tokens, "prompt": tokens[:2, :5]}, tmp_path / "given.pt")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", LOAD_REMOTE, str(out), str(tmp_path / "given.pt"),
                           str(tmp_path / "answer.pt")], check=False, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = torch.load(tmp_path / "answer.pt")
    assert answer["class"] == "SwarmBottleneckLlamaForCausalLM" and answer["dtype"] == "torch.float32"
    assert "trust_remote_code" in answer["refused"]  # never taken for a plain Llama without its boundaries
    with torch.no_grad():
        swarm = swarm_loss(workers, tokens, targets)
        ours = load_model(assemble(paths))
        theirs = torch.nn.functional.cross_entropy(answer["logits"].flatten(0, 1), targets.flatten())
        torch.testing.assert_close(theirs, swarm, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(answer["logits"], ours(tokens), rtol=1e-4, atol=1e-4)
        # generate's cached steps: each new token's logits are the full sequence's at that position
        sequences = answer["sequences"]
        assert sequences.shape == (2, 5 + 6)
        full = ours(sequences[:, :-1])[:, 4:]
        torch.testing.assert_close(answer["step_logits"], full, rtol=1e-4, atol=1e-4)

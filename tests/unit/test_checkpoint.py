"""Checkpoints: resume is bit-identical, and damaged checkpoints are refused by name."""

import json
import os
import stat

import pytest
import torch

from swarm_node.data.spec import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.state.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from swarm_node.train.worker import StageWorker

SPEC = RunSpec(run_id="ckpt", model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=8,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=3),
               inner=InnerHyper(lr=3e-3, warmup_steps=2, total_steps=50))
VOCAB = 16


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (4, 16), generator=g), torch.randint(0, VOCAB, (4, 16), generator=g)


def train(worker: StageWorker, steps: range) -> None:
    """Stage 1 on fake activations: forward, loss, backward, steps and outer rounds."""
    for step in steps:
        hidden = torch.randn(4, 16, worker.model_config.hidden_size,
                             generator=torch.Generator().manual_seed(step))
        worker.forward_backward_last(hidden, batch(step)[1])
        if worker.ready_to_step():
            worker.step()
        if worker.outer_round_due():
            worker.open_round()
            worker.close_round([])


def test_resume_is_bit_identical(tmp_path):
    original = StageWorker(SPEC, 1, VOCAB)
    train(original, range(15))  # ends with half a step of gradients accumulated
    assert any(p.grad is not None for p in original.params)
    tensors, meta = original.checkpoint_state()
    save_checkpoint(tmp_path, original.inner_step, tensors, {**meta, "spec_hash": SPEC.spec_hash()})

    resumed = StageWorker(SPEC, 1, VOCAB)
    loaded, loaded_meta = latest_checkpoint(tmp_path)
    resumed.load_checkpoint_state(loaded, loaded_meta)
    for key, value in resumed.checkpoint_state()[0].items():
        assert torch.equal(value, tensors[key]), key
    train(original, range(15, 30))
    train(resumed, range(15, 30))
    assert original.inner_step == resumed.inner_step and original.outer_round == resumed.outer_round >= 3
    after_a, after_b = original.checkpoint_state()[0], resumed.checkpoint_state()[0]
    assert after_a.keys() == after_b.keys()
    for key in after_a:
        assert torch.equal(after_a[key], after_b[key]), key


def _saved(tmp_path, step=5):
    worker = StageWorker(SPEC, 0, VOCAB)
    tensors, meta = worker.checkpoint_state()
    return save_checkpoint(tmp_path, step, tensors, meta)


def test_a_truncated_checkpoint_is_refused_with_a_clear_message(tmp_path):
    path = _saved(tmp_path)
    data = (path / "state.safetensors").read_bytes()
    (path / "state.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"state.safetensors has \d+ bytes but was written with \d+"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        latest_checkpoint(tmp_path)


def test_a_bit_flip_or_a_damaged_meta_file_is_refused(tmp_path):
    path = _saved(tmp_path)
    data = bytearray((path / "state.safetensors").read_bytes())
    data[-1] ^= 1
    (path / "state.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match the checksum"):
        load_checkpoint(path)
    (path / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(path)


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_loudly(tmp_path, caplog):
    _saved(tmp_path, step=5)
    newest = _saved(tmp_path, step=9)
    (newest / "meta.json").unlink()
    _, meta = latest_checkpoint(tmp_path)
    assert meta["step"] == 5
    assert any("skipping damaged checkpoint" in r.getMessage() for r in caplog.records)


def test_old_checkpoints_are_pruned_and_no_staging_directory_is_left(tmp_path):
    for step in (1, 2, 3, 4):
        _saved(tmp_path, step=step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000000003", "ckpt-0000000004"]
    assert json.loads((tmp_path / "ckpt-0000000004" / "meta.json").read_text())["step"] == 4


def test_a_checkpoint_of_another_stage_does_not_load(tmp_path):
    worker = StageWorker(SPEC, 0, VOCAB)
    tensors, meta = worker.checkpoint_state()
    with pytest.raises(ValueError, match="shape|lacks"):
        StageWorker(SPEC, 1, VOCAB).load_checkpoint_state(tensors, meta)
    assert latest_checkpoint(tmp_path / "missing") is None


@pytest.mark.parametrize("mask", [0o022, 0o077], ids=oct)
def test_checkpoint_files_get_the_mode_a_new_file_gets(tmp_path, mask):
    previous = os.umask(mask)
    try:
        path = _saved(tmp_path)
    finally:
        os.umask(previous)
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in path.iterdir()}
    assert set(modes) == {"state.safetensors", "meta.json"}
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes

"""`swarm-node export`/`generate` without transformers: which checkpoints of a stage may be
averaged (close ones are, far-apart ones are refused unless --force), what is refused
outright, the files' modes and the flags' help, and that a coded run's export computes the
swarm's loss (read back in pure torch). The transformers round trips are in
test_hf_export_slow.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import stat
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file

from swarm_node.cli.main import build_parser, main
from swarm_node.data.spec import DataSpec
from swarm_node.errors import ConfigError
from swarm_node.export.assemble import assemble
from swarm_node.export.hf import write_hf_checkpoint
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.state.checkpoint import save_checkpoint
from swarm_node.train.worker import StageWorker

H = 10
SPEC = RunSpec(run_id="export", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
               samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=H),
               inner=InnerHyper(lr=3e-3, warmup_steps=1, total_steps=2000))
LOCAL_SPEC = RunSpec(run_id="export-local", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
                   samples_per_step=4, data=DataSpec(kind="synthetic"), method=default_method("local"),
                   inner=InnerHyper(lr=3e-3, warmup_steps=1, total_steps=2000))
VOCAB = 16


def checkpoint(directory, stage: int, *, step: int, round_: int, offset: float = 0.0, peer: str | None = None,
               spec: RunSpec = SPEC):
    """A node's checkpoint of ``stage`` as a peer at ``step``/``round_`` writes it; the
    weights are the initial ones plus ``offset``, so averages are easy to check."""
    worker = StageWorker(spec, stage, VOCAB)
    tensors, meta = worker.checkpoint_state()
    for key in [k for k in tensors if k.startswith("theta.")]:
        tensors[key] = tensors[key] + offset
    meta.update(inner_step=step, outer_round=round_, spec_hash=spec.spec_hash(), run_id=spec.run_id,
                peer_id=peer or f"QmPeer{directory.name}", data=None)
    save_checkpoint(directory, step, tensors, meta)
    return directory


def initial(stage: int, name: str, spec: RunSpec = SPEC) -> torch.Tensor:
    worker = StageWorker(spec, stage, VOCAB)
    return dict(worker.stage.named_parameters())[name].detach()


def export(*argv: str) -> int:
    return main(["export", *argv])


def test_replicas_up_to_three_quarters_of_the_newest_ones_steps_apart_are_averaged_and_further_are_refused(
        tmp_path):
    s0 = checkpoint(tmp_path / "s0", 0, step=68, round_=6)
    a = checkpoint(tmp_path / "a", 1, step=68, round_=6, offset=1.0)
    b = checkpoint(tmp_path / "b", 1, step=272, round_=27, offset=3.0)  # at the limit: 204 of 272 steps apart
    assembled = assemble([s0, a, b])
    assert assembled.peers_per_stage == [1, 2]
    torch.testing.assert_close(assembled.state_dict["lm_head.weight"], initial(1, "lm_head.weight") + 2.0)
    c = checkpoint(tmp_path / "c", 1, step=273, round_=27)  # one step more
    with pytest.raises(ConfigError,
                       match=r"205 inner steps apart, more than 75% of the newest one's 273 and more "
                                          r"than 2\*H = 20"):
        assemble([s0, a, c])


def test_early_in_training_two_rounds_apart_are_still_averaged(tmp_path):
    s0 = checkpoint(tmp_path / "s0", 0, step=5, round_=0)
    a = checkpoint(tmp_path / "a", 1, step=5, round_=0)
    assert assemble([s0, a, checkpoint(tmp_path / "b", 1, step=5 + 2 * H, round_=2)]).peers_per_stage == [1,
                                                                                                          2]
    with pytest.raises(ConfigError, match="inner steps apart"):
        assemble([s0, a, checkpoint(tmp_path / "c", 1, step=5 + 2 * H + 1, round_=2)])


def test_far_apart_checkpoints_are_refused_in_one_line_naming_them_and_their_steps(tmp_path, capsys):
    s0 = checkpoint(tmp_path / "s0", 0, step=1426, round_=142)
    old = checkpoint(tmp_path / "old", 1, step=68, round_=6)
    new = checkpoint(tmp_path / "new", 1, step=1426, round_=142)
    out = tmp_path / "hf"
    assert export("--checkpoint", str(s0), str(old), str(new), "--out", str(out)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("swarm-node export: error: stage 1:")
    assert f"{old} at inner step 68, outer round 6" in lines[0]
    assert f"{new} at inner step 1426, outer round 142" in lines[0]
    assert "pass --force to average them anyway" in lines[0]
    assert not out.exists()


def test_force_averages_far_apart_checkpoints_with_one_warning_per_stage(tmp_path, caplog):
    dirs = [checkpoint(tmp_path / "s0-old", 0, step=68, round_=6, offset=0.0),
            checkpoint(tmp_path / "s0-new", 0, step=1426, round_=142, offset=2.0),
            checkpoint(tmp_path / "s1-old", 1, step=68, round_=6, offset=1.0),
            checkpoint(tmp_path / "s1-new", 1, step=1426, round_=142, offset=3.0)]
    out = tmp_path / "hf"
    assert export("--checkpoint", *map(str, dirs), "--out", str(out), "--force") == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(
        "stage 0: averaging checkpoints 1358 inner steps apart, more than 75% of the "
        "newest one's 1426 and more than 2*H = 20 as --force asks"
    )
    assert warnings[1].startswith("stage 1:")
    tensors = load_file(out / "model.safetensors")
    torch.testing.assert_close(tensors["lm_head.weight"], initial(1, "lm_head.weight") + 2.0)
    torch.testing.assert_close(
        tensors["model.embed_tokens.weight"], initial(0, "model.embed_tokens.weight") + 1.0
    )


def test_without_outer_rounds_checkpoints_more_than_three_quarters_of_the_steps_apart_are_refused(tmp_path):
    s0 = checkpoint(tmp_path / "s0", 0, step=1000, round_=0, spec=LOCAL_SPEC)
    a = checkpoint(tmp_path / "a", 1, step=1000, round_=0, spec=LOCAL_SPEC)
    close = checkpoint(tmp_path / "close", 1, step=4000, round_=0, spec=LOCAL_SPEC)  # 3000 <= 3/4 of 4000
    far = checkpoint(tmp_path / "far", 1, step=4004, round_=0, spec=LOCAL_SPEC)
    assert assemble([s0, a, close]).peers_per_stage == [1, 2]
    with pytest.raises(ConfigError,
                       match=r"3004 inner steps apart, more than 75% of the newest one's 4004 \(.*far "
                                          r"at inner step 4004\)"):
        assemble([s0, a, far])


def test_a_stage_given_twice_from_one_peer_is_refused_even_with_force(tmp_path, capsys):
    s0 = checkpoint(tmp_path / "s0", 0, step=70, round_=7)
    first = checkpoint(tmp_path / "first", 1, step=60, round_=6, peer="QmSame")
    again = checkpoint(tmp_path / "again", 1, step=70, round_=7, peer="QmSame")
    assert export("--checkpoint", str(s0), str(first), str(again), "--out", str(tmp_path / "hf"),
                  "--force") == 2
    err = capsys.readouterr().err
    assert (
        "stage 1 is given twice from peer QmSame" in err
        and "export the newest checkpoint of each peer" in err
    )


def test_checkpoints_of_different_runs_are_refused_even_with_force(tmp_path):
    s0 = checkpoint(tmp_path / "s0", 0, step=70, round_=7)
    other = checkpoint(tmp_path / "s1", 1, step=70, round_=7, spec=LOCAL_SPEC)
    with pytest.raises(ConfigError, match=f"{other} belongs to run spec {LOCAL_SPEC.spec_hash()} .* "
                                          f"{s0} to {SPEC.spec_hash()} .*give checkpoints of one run only"):
        assemble([s0, other], force=True)


@contextmanager
def umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002], ids=oct)
def test_every_exported_file_gets_the_mode_a_new_file_gets(tmp_path, mask):
    assembled = assemble([checkpoint(tmp_path / "s0", 0, step=5, round_=0),
                          checkpoint(tmp_path / "s1", 1, step=5, round_=0)])
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    with umask(mask):
        written = write_hf_checkpoint(assembled, tmp_path / "hf", tokenizer)
    assert {p.name for p in written} >= {"model.safetensors", "config.json", "tokenizer.json"}
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes


def test_every_flag_of_export_and_generate_has_help(capsys):
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("export", "generate"):
        parser = subparsers.choices[command]
        for action in parser._actions:
            assert action.help and action.help != argparse.SUPPRESS, f"{command} {action.option_strings}"
        parser.format_help()  # every help string formats (a bare % in one raises)


CODED = {codec: RunSpec(run_id=f"export-{codec}", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
                        samples_per_step=4, data=DataSpec(kind="synthetic"), method=default_method("noloco"),
                        inner=InnerHyper(lr=3e-3, warmup_steps=1, total_steps=2000), activation_codec=codec,
                        activation_ratio=8.0)
         for codec in ("subspace4", "bottleneck8")}


def coded_checkpoints(tmp_path, spec: RunSpec) -> tuple[list, list[StageWorker]]:
    """Both stages' checkpoints, their weights moved off the initial ones (a trained
    subspace model's still lie in its subspace: only the coefficients move)."""
    g = torch.Generator().manual_seed(1)
    workers, paths = [], []
    for stage in range(spec.num_stages):
        worker = StageWorker(spec, stage, VOCAB)
        with torch.no_grad():
            for p in worker.params:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        tensors, meta = worker.checkpoint_state()
        meta.update(inner_step=10, outer_round=1, peer_id=f"QmStage{stage}", data=None)
        save_checkpoint(tmp_path / f"s{stage}", 10, tensors, meta)
        workers.append(worker)
        paths.append(tmp_path / f"s{stage}")
    return paths, workers


def test_a_subspace_run_exports_as_a_plain_llama_whose_loss_is_the_swarms(tmp_path):
    from swarm_node.export.assemble import load_model

    spec = CODED["subspace4"]
    paths, (first, last) = coded_checkpoints(tmp_path, spec)
    assembled = assemble(paths)
    hidden = assembled.config.hidden_size
    assert assembled.config.boundary is None and assembled.config == StageWorker(SPEC, 0, VOCAB).model_config
    assert assembled.state_dict["model.layers.0.self_attn.o_proj.weight"].shape == (hidden, hidden)
    g = torch.Generator().manual_seed(2)
    inputs = torch.randint(0, VOCAB, (4, 16), generator=g)
    targets = torch.randint(0, VOCAB, (4, 16), generator=g)
    with torch.no_grad():
        swarm = last.stage(first.stage(inputs), targets, tokens=inputs)  # the code between, unrounded
        plain = load_model(assembled)(inputs, targets)
    torch.testing.assert_close(plain, swarm, rtol=1e-5, atol=1e-5)
    assert export("--checkpoint", *map(str, paths), "--out", str(tmp_path / "hf")) == 0


def swarm_loss(workers: list[StageWorker], inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of the stages chained as the swarm runs them (the code between, unrounded)."""
    hidden = workers[0].stage(inputs)
    for worker in workers[1:-1]:
        hidden = worker.stage(hidden, tokens=inputs)
    return workers[-1].stage(hidden, targets, tokens=inputs)


BOTTLENECK = {
    "2-stages": CODED["bottleneck8"],
    # 3 stages: a middle stage's boundary reads the anchor before it; cuts before layer 0 and after the last
    **{f"layers-{'-'.join(map(str, layers))}": dataclasses.replace(
        CODED["bottleneck8"], run_id=f"export-bottleneck-{''.join(map(str, layers))}", num_stages=3,
        layers_per_stage=layers, activation_codec="bottleneck4") for layers in [(0, 1, 1), (1, 1, 0)]}}


@pytest.mark.parametrize("spec", BOTTLENECK.values(), ids=BOTTLENECK.keys())
def test_a_bottleneck_run_exports_its_boundary_layers_and_the_folder_gives_the_swarms_loss(tmp_path, spec):
    from swarm_node.export.hf import MODELLING_FILE, load_exported

    paths, workers = coded_checkpoints(tmp_path, spec)
    out = tmp_path / "hf"
    assert export("--checkpoint", *map(str, paths), "--out", str(out)) == 0
    config = json.loads((out / "config.json").read_text())
    cuts = list(spec.model(VOCAB)[0].boundary.cuts)
    assert config["architectures"] == ["SwarmBottleneckLlamaForCausalLM"]
    assert config["model_type"] == "swarm_bottleneck_llama"
    assert config["auto_map"]["AutoModelForCausalLM"] == \
        "modeling_swarm_bottleneck.SwarmBottleneckLlamaForCausalLM"
    width = workers[0].boundary.width
    assert config["swarm_boundary"] == {"kind": "bottleneck", "width": width, "cuts": cuts}
    assert (out / MODELLING_FILE.name).read_text() == MODELLING_FILE.read_text()
    tensors = load_file(out / "model.safetensors")
    assert {f"boundaries.sides.{i}.{part}.weight" for i in range(len(cuts))
            for part in ("encoder", "decoder", "anchor")} <= set(tensors)
    exported = load_exported(out)  # pure torch: the folder's config and weights, read back
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        inputs = torch.randint(0, VOCAB, (4, 16), generator=g)
        targets = torch.randint(0, VOCAB, (4, 16), generator=g)
        with torch.no_grad():
            swarm, got = swarm_loss(workers, inputs, targets), exported(inputs, targets)
        torch.testing.assert_close(got, swarm, rtol=1e-5, atol=1e-5)


def test_a_plain_export_reads_back_as_the_same_model(tmp_path):
    from swarm_node.export.assemble import load_model
    from swarm_node.export.hf import load_exported

    assembled = assemble([checkpoint(tmp_path / "s0", 0, step=5, round_=0, offset=0.01),
                          checkpoint(tmp_path / "s1", 1, step=5, round_=0, offset=-0.01)])
    write_hf_checkpoint(assembled, tmp_path / "hf")
    assert not (tmp_path / "hf" / "modeling_swarm_bottleneck.py").exists()
    inputs = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(load_exported(tmp_path / "hf")(inputs), load_model(assembled)(inputs))


def test_generate_samples_from_a_bottleneck_run(tmp_path, capsys):
    paths, _ = coded_checkpoints(tmp_path, CODED["bottleneck8"])
    assert main(["generate", "--checkpoint", *map(str, paths), "--prompt", "abc", "--max-new-tokens", "5",
                 "--seed", "3"]) == 0
    text = capsys.readouterr().out.strip()
    assert text.startswith("abc") and len(text) == 8 and set(text) <= set("abcdefghijklmnop")

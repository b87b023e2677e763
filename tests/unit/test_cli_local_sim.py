"""`swarm-node local` and `swarm-node sim` on the command line: every flag explained, and
every configuration that cannot work refused before any process or daemon starts."""

import argparse
import re

import pytest
import torch

from swarm_node import system
from swarm_node.cli import main as cli
from swarm_node.cli.args import MODEL_HELP
from swarm_node.local import swarm as local
from swarm_node.model.config import NAMED_SIZES
from swarm_node.state.checkpoint import save_checkpoint


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["sim", "local"])
def test_every_flag_has_help(command):
    actions = [a for a in _subparser(command)._actions if not isinstance(a, argparse._HelpAction)]
    assert actions
    missing = [a.option_strings[0] for a in actions if not a.help or a.help == argparse.SUPPRESS]
    assert not missing, f"flags of `swarm-node {command}` without help: {missing}"


def test_model_help_lists_the_layers_of_every_size():
    for name, (_, layers, *_) in NAMED_SIZES.items():
        assert re.search(rf"\b{name} \({layers}\b", MODEL_HELP), name


def test_threads_help_says_what_the_default_is():
    threads = next(a for a in _subparser("sim")._actions if "--threads" in a.option_strings)
    assert "default: the cores not already busy" in threads.help


@pytest.fixture
def nothing_may_start(monkeypatch):
    """Any DHT, process or swarm started fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("something was started before the configuration was refused")

    monkeypatch.setattr(local.SwarmDHT, "start", refuse)
    monkeypatch.setattr(local.subprocess, "Popen", refuse)
    monkeypatch.setattr(local.LocalSwarm, "_spawn_all", refuse)


def test_local_refuses_more_stages_than_layers_before_anything_starts(nothing_may_start, capsys):
    code = cli.main(["local", "--stages", "3", "--replicas", "2", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "the debug model has 2 layers, which cannot be split into 3 stages" in err
    assert "--stages 2 or fewer" in err and "tiny: 4 layers" in err and "--layers-per-stage 0,1,1" in err
    assert len(err.strip().splitlines()) == 1


def test_the_split_suggested_for_local_is_accepted(nothing_may_start, monkeypatch, capsys):
    seen = {}

    def fake_run_local(spec, config, json_out):
        seen["spec"] = spec
        return {"final_val_loss": 1.0}

    monkeypatch.setattr(local, "run_local", fake_run_local)
    assert cli.main(["local", "--stages", "3", "--layers-per-stage", "0,1,1", "--no-progress"]) == 0
    assert seen["spec"].layers_per_stage == (0, 1, 1) and seen["spec"].num_stages == 3


def test_local_refuses_an_unknown_model_and_lists_the_known_ones(nothing_may_start, capsys):
    assert cli.main(["local", "--model", "huge", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown model size 'huge'" in err and all(name in err for name in NAMED_SIZES)


def test_local_refuses_data_it_cannot_read_before_anything_starts(nothing_may_start, tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    assert cli.main(["local", "--data", f"text:{missing}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "--data" in err


def test_local_refuses_a_checkpoint_dir_holding_an_earlier_run(nothing_may_start, tmp_path, capsys):
    save_checkpoint(tmp_path / "ckpts" / "stage1-r0", 5, {"theta.0": torch.zeros(2)}, {"stage": 1})
    code = cli.main(["local", "--data", "synthetic:tokens=20000", "--checkpoint-dir", str(tmp_path / "ckpts"),
                     "--no-progress"])
    assert code == 2
    assert "already holds checkpoints" in capsys.readouterr().err


def test_join_refuses_a_spec_with_an_impossible_split_before_the_node_starts(tmp_path, nothing_may_start,
                                                                             capsys):
    spec = tmp_path / "run.toml"
    spec.write_text('run_id = "x"\nmodel_size = "debug"\nnum_stages = 3\n')
    assert cli.main(["join", "--config", str(spec), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot be split into 3 stages" in err and "num_stages 2 or fewer" in err


def test_sim_refuses_an_impossible_split_with_the_flags_to_change(capsys):
    assert cli.main(["sim", "--stages", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot be split into 4 stages" in err and "--stages 2 or fewer" in err


def test_sim_without_threads_uses_the_default_rule(monkeypatch):
    import swarm_node.sim.run

    threads = []
    monkeypatch.setattr(system, "default_threads", lambda: 2)
    monkeypatch.setattr(swarm_node.sim.run, "run_simulation",
                        lambda config, **kwargs: threads.append(torch.get_num_threads()))
    try:
        assert cli.main(["sim", "--steps", "1", "--no-progress"]) == 0
        assert cli.main(["sim", "--steps", "1", "--threads", "1", "--no-progress"]) == 0
    finally:
        torch.set_num_threads(1)
    assert threads == [2, 1]

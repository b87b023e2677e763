"""One place per flag (issue 53): every flag of the two programs is declared in one
function of one module, the options commands share have one help text (the differences
between commands are parameters, and only the ones listed here), and the flags that set
run-spec keys are the table in swarm_node/cli/spec_flags.py, which `local` builds its
run spec from, the simulator follows and docs/RESEARCHERS.md prints."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from swarm_bootstrap import cli as bootstrap_cli

from swarm_node.cli import main as cli
from swarm_node.cli import options
from swarm_node.cli.spec_flags import SPEC_FLAGS, spec_flag_table
from swarm_node.config import default_warmup_steps, suggested_lr
from swarm_node.data.spec import DataSpec
from swarm_node.local import swarm as local
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec

REPO = Path(__file__).resolve().parents[2]
CLI_MODULES = [*sorted((REPO / "swarm_node" / "cli").glob("*.py")), REPO / "bootstrap" / "cli.py"]


def declarations() -> dict[str, set[str]]:
    """flag -> the "module:function" places whose add_argument calls name it."""
    places = defaultdict(set)
    for path in CLI_MODULES:
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            for call in ast.walk(function):
                if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "add_argument":
                    for arg in call.args:
                        if isinstance(arg, ast.Constant) and str(arg.value).startswith("-"):
                            places[arg.value].add(f"{path.relative_to(REPO)}:{function.name}")
    return places


def test_no_flag_is_declared_in_two_places():
    places = declarations()
    # it reads them
    assert {"--method", "--port", "--data", "--checkpoint", "--maddrs-file", "-v"} <= set(places)
    twice = {flag: sorted(where) for flag, where in places.items() if len(where) > 1}
    assert not twice, f"declared in more than one place: {twice}"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found.update({f"{name} {n}": s for n, s in _subparsers(sub).items()})
    return found


def parsers() -> dict[str, argparse.ArgumentParser]:
    return {"swarm-node": cli.build_parser(), **_subparsers(cli.build_parser()),
            "swarm-bootstrap": bootstrap_cli.build_parser()}


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


# (flag, command, command): the help texts that differ between two commands, on purpose
# (the text says how); any other pair of commands sharing a flag shares its help text,
# `local`'s "every node: " prefix aside.
DIFFERENT_HELP = {("--replicas", "local", "sim"), ("--steps", "local", "sim"), ("--method", "local", "sim"),
                  ("--outer-codec", "local", "sim"), ("--activation-codec", "local", "sim"),
                  ("--threads", "join", "sim"), ("--run-dir", "join", "local"),
                  ("--checkpoint-dir", "join", "local"), ("--no-progress", "data prepare", "join"),
                  ("--no-progress", "join", "local"), ("--no-progress", "join", "sim"),
                  ("--data-cache", "export", "join"), ("--data-cache", "generate", "join"),
                  ("--tokenizer", "data prepare", "export"), ("--tokenizer", "data prepare", "generate"),
                  ("--tokenizer", "data prepare", "sim"), ("--tokenizer", "export", "sim"),
                  ("--tokenizer", "generate", "sim"), ("--seed", "generate", "local"),
                  ("--seed", "generate", "sim"), ("--out", "data prepare", "export"),
                  ("--data", "local", "swarm-bootstrap"), ("--data", "sim", "swarm-bootstrap"),
                  ("--initial-peers", "join", "swarm-bootstrap"), ("--run-id", "join", "swarm-bootstrap"),
                  ("--identity", "join", "swarm-bootstrap"), ("--port", "join", "swarm-bootstrap"),
                  ("--http-port", "join", "swarm-bootstrap"),}


def test_commands_that_share_a_flag_share_its_help_text():
    found = parsers()
    commands = {name: p for name, p in found.items() if name != "data"}
    checked, differing = 0, set()
    names = sorted(commands)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            for action in commands[first]._actions:
                flag = action.option_strings[-1] if action.option_strings else None
                if flag in (None, "--help") or flag not in commands[second]._option_string_actions:
                    continue
                texts = {str(a.help).removeprefix("every node: ")
                         for a in (action, _action(commands[second], flag))}
                if len(texts) > 1:
                    differing.add((flag, first, second))
                checked += 1
    assert checked > 40
    assert differing == DIFFERENT_HELP


def test_the_real_differences_between_commands():
    found = parsers()

    def default(command, flag):
        return _action(found[command], flag).default

    assert _action(found["sim"], "--method").choices == ("noloco", "diloco", "ddp", "local")
    assert _action(found["local"], "--method").choices == ("noloco", "diloco", "local")
    for flag in ("--outer-codec", "--activation-codec"):
        assert default("sim", flag) == "fp32" and default("local", flag) is None  # local: the run spec's
        assert "measured against" in _action(found["sim"], flag).help  # why they differ
    assert (default("join", "--device"), default("local", "--device"), default("sim", "--device")) == \
        ("auto", "cpu", "cpu")
    assert (default("sim", "--replicas"), default("local", "--replicas")) == (4, 2)
    assert (default("sim", "--steps"), default("local", "--steps")) == (1000, 200)
    assert (default("join", "--round-timeout"), default("local", "--round-timeout")) == (20.0, 15.0)
    assert (default("join", "--port"), default("swarm-bootstrap", "--port")) == (31338, None)  # None: 31337
    assert (default("join", "--http-port"), default("swarm-bootstrap", "--http-port")) == (None, 8080)
    assert (default("join", "--http-host"), default("swarm-bootstrap", "--http-host")) == ("127.0.0.1",
                                                                                           "0.0.0.0")
    assert default("join", "--identity") is None
    assert default("swarm-bootstrap", "--identity") == bootstrap_cli.DEFAULT_IDENTITY


def test_every_help_page_formats():
    for name, parser in parsers().items():
        assert parser.format_help(), name  # a stray % in a help text raises here


def test_the_bootstrap_parses_without_torch():
    """swarm-bootstrap trains nothing: its options, declared beside the node's, import no torch."""
    code = "import sys, swarm_bootstrap.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_the_method_names_are_the_packages():
    from swarm_node.optim.methods import METHODS
    from swarm_node.spec import SWARM_METHODS

    assert options.SWARM_METHODS == SWARM_METHODS
    assert set(options.SIM_METHODS) == set(METHODS)


# -- the run-spec table -------------------------------------------------------------------------

def _field(obj, key: str):
    for name in key.split("."):
        obj = getattr(obj, name)
    return obj


def test_every_row_names_flags_its_commands_have_and_keys_a_spec_has():
    found = parsers()
    for row in SPEC_FLAGS:
        for command in ("local", "sim"):
            assert (row.flag in found[command]._option_string_actions) == (command in row.commands), \
                (row.flag, command)
        assert _action(found[row.commands[0]], row.flag).dest == row.dest
        for key in row.keys:
            _field(RunSpec(), key)  # raises when the spec has no such key


# Values unlike every default, for each flag of the table.
GIVEN = {"--model": "tiny", "--stages": "3", "--layers-per-stage": "1,2,1", "--seq-len": "33",
         "--batch-size": "5",
         "--steps": "77", "--seed": "9", "--data": "synthetic:alphabet=12", "--tokenizer": "tok.json",
         "--method": "diloco", "--inner-steps": "7", "--group-size": "3", "--alpha": "0.11", "--beta": "0.22",
         "--gamma": "0.33", "--nesterov": None, "--lr": "0.0123", "--warmup-steps": "4",
         "--weight-decay": "0.01",
         "--outer-codec": "int8", "--activation-codec": "subspace8", "--activation-ratio": "16",
         "--registry-shards": "4"}


def _argv(command: str) -> list[str]:
    argv = []
    for row in SPEC_FLAGS:
        if command in row.commands:
            argv += [row.flag] if GIVEN[row.flag] is None else [row.flag, GIVEN[row.flag]]
    return argv


def _expected(row, key: str):
    if row.flag == "--data":
        return DataSpec.parse(GIVEN["--data"])
    action = _action(parsers()[row.commands[0]], row.flag)
    return (
        True if GIVEN[row.flag] is None else action.type(GIVEN[row.flag]) if action.type else GIVEN[row.flag]
    )


@pytest.fixture
def local_spec(monkeypatch):
    """The run spec `swarm-node local ARGS` would start, nothing started."""
    def spec_of(argv):
        seen = {}

        def fake_run_local(spec, config, json_out):
            seen["spec"] = spec
            return {"final_val_loss": 1.0}

        monkeypatch.setattr(local, "run_local", fake_run_local)
        assert cli.main(["local", *argv, "--no-progress"]) == 0
        return seen["spec"]

    return spec_of


def test_local_builds_its_run_spec_from_the_table(local_spec):
    spec = local_spec(_argv("local"))
    for row in SPEC_FLAGS:
        if "local" in row.commands:
            for key in row.keys:
                assert _field(spec, key) == _expected(row, key), (row.flag, key)
    # what a spec file leaves out follows from what it gives, as for a file
    assert spec.inner == InnerHyper(lr=0.0123, warmup_steps=default_warmup_steps(77), total_steps=77)


def test_local_without_flags_builds_the_spec_it_always_did(local_spec):
    spec = local_spec([])
    assert spec == RunSpec(run_id=spec.run_id, model_size="debug", num_stages=2, seq_len=64, batch_size=8,
                           samples_per_step=8, total_steps=200, seed=0, data=DataSpec.parse("corpus"),
                           method=default_method("noloco"), registry_shards=1,
                           inner=InnerHyper(lr=suggested_lr("debug"), warmup_steps=default_warmup_steps(200),
                                            total_steps=200))


# The simulator's settings by run-spec key, where its names are not the spec's.
SIM_FIELDS = {"num_stages": "stages", "total_steps": "steps", "samples_per_step": "batch_size"}


def test_the_simulator_follows_the_table(monkeypatch):
    import swarm_node.data.tokenizer
    import swarm_node.sim.run

    seen = []
    monkeypatch.setattr(swarm_node.sim.run, "run_simulation", lambda config, **kwargs: seen.append(config))
    monkeypatch.setattr(swarm_node.data.tokenizer, "HFTokenizer", lambda path, flag: None)  # no file read
    try:
        assert cli.main(["sim", *_argv("sim"), "--threads", "1", "--no-progress"]) == 0
    finally:
        torch.set_num_threads(1)
    config = seen[0]
    for row in SPEC_FLAGS:
        if "sim" in row.commands:
            for key in row.keys:
                expected = _expected(row, key)
                if row.flag == "--data":
                    expected = dataclasses.replace(expected, tokenizer_path=GIVEN["--tokenizer"])
                assert _field(config, SIM_FIELDS.get(key, key)) == expected, (row.flag, key)


def test_the_researchers_guide_prints_the_table():
    guide = (REPO / "docs" / "RESEARCHERS.md").read_text()
    assert spec_flag_table() in guide, spec_flag_table()

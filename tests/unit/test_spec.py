import dataclasses
import re

import pytest

from swarm_node.errors import ConfigError
from swarm_node.spec import RunSpec

TOML = """
run_id = "demo"
model_size = "debug"
num_stages = 2
seq_len = 32
total_steps = 500

[data]
kind = "synthetic"
order = 1

[method]
name = "noloco"
inner_steps = 25

[method.outer]
alpha = 0.4

[inner]
lr = 0.002
"""


def test_toml_round_trip_and_defaults(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    spec = RunSpec.from_toml(path)
    assert spec.run_id == "demo" and spec.data.order == 1 and spec.method.inner_steps == 25
    assert spec.method.outer.alpha == 0.4 and spec.method.outer.gamma == 0.7  # unset keys keep defaults
    assert spec.inner.lr == 0.002 and spec.inner.total_steps == 500 and spec.inner.warmup_steps == 20
    assert RunSpec.from_dict(spec.to_dict()) == spec
    assert RunSpec.from_dict(spec.to_dict()).spec_hash() == spec.spec_hash()


def test_hash_changes_with_any_shared_setting():
    base = RunSpec()
    assert dataclasses.replace(base, seq_len=65).spec_hash() != base.spec_hash()
    assert dataclasses.replace(base, run_id="other").spec_hash() != base.spec_hash()
    assert len(base.spec_hash()) == 16


@pytest.mark.parametrize("bad", [{"seq_len": 0}, {"nonsense": 1}, {"method": {"name": "sgd"}},
                                 {"data": {"kind": "text"}}, {"inner": {"lr": -1}}])
def test_bad_specs_raise_config_error(bad):
    with pytest.raises(ConfigError):
        RunSpec.from_dict(bad)


def test_missing_or_broken_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        RunSpec.from_toml(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("run_id = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        RunSpec.from_toml(tmp_path / "bad.toml")


def test_version_gate():
    spec = RunSpec(min_version="0.2.0")
    assert not spec.compatible_version("0.1.9")
    assert spec.compatible_version("0.2.0") and spec.compatible_version("1.0.0rc1")


def test_example_run_specs_parse():
    from pathlib import Path

    examples = sorted(Path(__file__).resolve().parents[2].joinpath("examples").glob("*.toml"))
    assert examples
    for path in examples:
        RunSpec.from_toml(path)


def test_a_split_the_model_cannot_take_is_refused_with_the_fixes():
    with pytest.raises(ConfigError) as caught:
        RunSpec(model_size="debug", num_stages=3)
    message = str(caught.value)
    assert "the debug model has 2 layers, which cannot be split into 3 stages" in message
    assert "num_stages 2 or fewer" in message and "tiny: 4 layers" in message
    assert "layers_per_stage 0,1,1" in message
    RunSpec(model_size="debug", num_stages=3, layers_per_stage=(0, 1, 1))  # the suggested split is accepted
    RunSpec(model_size="tiny", num_stages=3)


@pytest.mark.parametrize("stages", [3, 4, 5, 6])
def test_every_suggested_explicit_split_is_accepted(stages):
    checked = 0
    for size in ("debug", "tiny"):
        try:
            RunSpec(model_size=size, num_stages=stages)
        except ConfigError as exc:
            suggested = re.search(r"layers_per_stage ([\d,]+)", str(exc))
            if suggested:
                split = tuple(int(x) for x in suggested.group(1).split(","))
                assert RunSpec(model_size=size, num_stages=stages,
                               layers_per_stage=split).layers_per_stage == split
                checked += 1
    assert checked >= 1


def test_unknown_model_size_lists_the_known_ones():
    with pytest.raises(ConfigError,
                       match=r"unknown model size 'huge'.*debug \(2 layers\).*large \(32 layers\)"):
        RunSpec(model_size="huge")


@pytest.mark.parametrize("raw", [{"num_stages": 3}, {"model_size": "huge"}, {"layers_per_stage": [1, 2]},
                                 {"num_stages": 2, "layers_per_stage": [0, 1, 1]},
                                 {"method": {"name": "ddp"}}])
def test_spec_files_with_impossible_models_or_methods_are_refused(raw):
    with pytest.raises(ConfigError, match="invalid run spec"):
        RunSpec.from_dict(raw)


def test_ddp_is_refused_for_a_swarm_and_the_message_says_where_it_runs():
    from swarm_node.optim import default_method

    with pytest.raises(ConfigError, match=r"only in the simulator \(swarm-node sim\)"):
        RunSpec(method=default_method("ddp"))

import dataclasses

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

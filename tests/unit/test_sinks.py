"""Metrics sinks: JSON lines by default; a failing sink is dropped, training goes on."""

import json
import logging

import pytest

from swarm_node.obs.sinks import JsonlSink, Sinks, open_sinks


def test_jsonl_sink_appends_one_flushed_object_per_log(tmp_path):
    sinks = open_sinks(("jsonl",), tmp_path, run_name="stage0-abc", project="run", config={})
    sinks.log(10, {"train_loss": 2.5, "tokens": 640})
    path = tmp_path / "metrics-stage0-abc.jsonl"
    assert json.loads(path.read_text())["train_loss"] == 2.5  # readable before close: flushed
    sinks.log(20, {"train_loss": 2.25, "tokens": 1280})
    sinks.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["tokens"]) for r in rows] == [(10, 640),
                                                        (20, 1280)] and all("time" in r for r in rows)


def test_a_failing_sink_is_dropped_with_one_error_and_the_others_keep_logging(tmp_path, caplog):
    class Broken:
        calls = 0

        def log(self, step, metrics):
            Broken.calls += 1
            raise OSError("No space left on device")

        def close(self):
            pass

    good = JsonlSink(tmp_path / "m.jsonl")
    sinks = Sinks([Broken(), good])
    with caplog.at_level(logging.ERROR):
        for step in range(3):
            sinks.log(step, {"x": float(step)})
    sinks.close()
    assert Broken.calls == 1 and caplog.text.count("No space left on device") == 1
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3


def test_unknown_sink_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown metrics sink 'csv'"):
        open_sinks(("csv",), tmp_path, run_name="r", project="p", config={})

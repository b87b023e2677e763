"""The optional metrics sinks, against their own readers. Slow tier: they need the
`tensorboard` and `wandb` extras, which `./dev.sh test-slow` installs."""

import pytest

from swarm_node.obs.sinks import open_sinks


@pytest.mark.slow
def test_tensorboard_sink_writes_scalars_tensorboard_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = open_sinks(("tensorboard",), tmp_path, run_name="stage1-abc", project="run", config={})
    for step, loss in ((25, 2.5), (50, 2.0)):
        sinks.log(step, {"train_loss": loss, "tokens": step * 64})
    sinks.close()
    events = EventAccumulator(str(tmp_path / "tensorboard" / "stage1-abc"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [(25, 2.5), (50, 2.0)]


@pytest.mark.slow
def test_wandb_sink_writes_an_offline_run_with_the_logged_values(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = open_sinks(("wandb",), tmp_path, run_name="stage1-abc", project="run", config={"stage": 1})
    for step, loss in ((25, 2.625), (50, 1.875)):
        sinks.log(step, {"train_loss": loss})
    sinks.close()
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (log,) = runs[0].glob("run-*.wandb")  # the protobuf log `wandb sync` uploads; no reader ships with wandb
    raw = log.read_bytes()
    assert raw.count(b"train_loss") >= 2 and b"2.625" in raw and b"1.875" in raw

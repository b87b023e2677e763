"""`swarm-node local` without processes: the progress bar while the swarm trains and the
final evaluation of the collected weights."""

import asyncio
import logging

import torch

from swarm_node import __version__, local
from swarm_node.data.spec import DataSpec
from swarm_node.model.config import model_config
from swarm_node.model.stages import build_stage
from swarm_node.spec import RunSpec
from swarm_node.wire.records import PeerRecord

DATA = DataSpec(kind="synthetic", order=1, num_tokens=20_000)


class FakeProcess:
    """A stage-0 node that runs for ``polls`` polls, then exits cleanly."""

    def __init__(self, polls: int):
        self.polls, self.pid = polls, 0

    def poll(self):
        self.polls -= 1
        return None if self.polls >= 0 else 0


def test_the_bar_shows_no_loss_before_the_last_stage_reports_one(tmp_path, monkeypatch, capsys):
    spec = RunSpec(run_id="watch", num_stages=1, seq_len=16, data=DATA)
    swarm = local.LocalSwarm(spec, local.LocalConfig(replicas=1, steps=10, run_dir=tmp_path))
    swarm.children = [local.Child(0, 0, FakeProcess(polls=2), tmp_path / "node.log")]
    monkeypatch.setattr(local, "_reap_group", lambda pgid: None)

    async def records(dht):  # training, but no loss yet
        return {0: [PeerRecord(stage=0, spec_hash=spec.spec_hash(), version=__version__, inner_step=4, loss=None)]}

    monkeypatch.setattr(swarm, "_records", records)
    asyncio.run(swarm._watch(None, 0.0))
    err = capsys.readouterr().err
    assert "nan" not in err and "10/10" in err  # the bar ends where stage 0 did


def test_the_final_evaluation_logs_each_path_and_uses_its_threads(tmp_path, monkeypatch, caplog):
    spec = RunSpec(run_id="eval", num_stages=2, seq_len=16, data=DataSpec(kind="synthetic", num_tokens=120_000))
    swarm = local.LocalSwarm(spec, local.LocalConfig(replicas=2, eval_batches=2, eval_threads=2, run_dir=tmp_path,
                                                     progress=False))
    swarm.preflight()
    config = model_config("debug", vocab_size=swarm.data.vocab_size, max_seq_len=16)
    weights = {s: {r: build_stage(config, num_stages=2, stage_index=s, seed=r + 1).state_dict() for r in range(2)}
               for s in range(2)}
    threads = []
    evaluate = local.path_val_loss

    def counting(*args, **kwargs):
        threads.append(torch.get_num_threads())
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(local, "path_val_loss", counting)
    try:
        with caplog.at_level(logging.INFO, logger="swarm_node.local"):
            result = swarm._evaluate(weights)
    finally:
        torch.set_num_threads(1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("evaluating 4 model paths (the initial weights, 2 replicas, the consensus model) "
                               "on 2 validation batches of 64 windows with 2 torch threads")
    assert [line.split(":")[0] for line in lines[1:]] == [
        "evaluated the initial weights (1 of 4)", "evaluated replica 0 (2 of 4)", "evaluated replica 1 (3 of 4)",
        "evaluated the consensus model (4 of 4)"]
    assert threads == [2, 2, 2, 2]
    assert result["final_consensus_val_loss"] is not None and result["initial_val_loss"] > 0


def test_nodes_crowding_few_cores_get_longer_to_reach_the_bootstrap(tmp_path, monkeypatch):
    spec = RunSpec(model_size="debug", num_stages=2, data=DATA)
    monkeypatch.setattr(local, "usable_cores", lambda: 2.0)
    few = local.LocalSwarm(spec, local.LocalConfig(replicas=2, run_dir=tmp_path))
    assert few.startup_timeout_s() == local.DEFAULT_STARTUP_TIMEOUT_S  # the demo: the join's own default
    crowd = local.LocalSwarm(spec, local.LocalConfig(replicas=16, run_dir=tmp_path))
    assert crowd.startup_timeout_s() == 32 / 2 * local.STARTUP_S_PER_NODE_A_CORE > local.DEFAULT_STARTUP_TIMEOUT_S
    spawned = []
    monkeypatch.setattr(local.subprocess, "Popen", lambda cmd, **kw: spawned.append(cmd) or FakeProcess(0))
    crowd._spawn_args = (tmp_path / "spec.json", ["/ip4/127.0.0.1/tcp/1/p2p/Qm"])
    crowd._spawn(1, 0)
    assert spawned[0][spawned[0].index("--startup-timeout") + 1] == str(crowd.startup_timeout_s())


def test_the_nodes_of_a_local_swarm_wait_for_each_other_and_a_restarted_one_does_not(tmp_path, monkeypatch):
    """Started together, a node up seconds before the others on a loaded machine took all
    of a short run's rounds alone (seen in CI: a stage-1 peer with 0 rounds paired)."""
    spec = RunSpec(model_size="debug", num_stages=2, data=DATA)
    swarm = local.LocalSwarm(spec, local.LocalConfig(replicas=3, run_dir=tmp_path))
    spawned = []
    monkeypatch.setattr(local.subprocess, "Popen", lambda cmd, **kw: spawned.append(cmd) or FakeProcess(0))
    swarm._spawn_args = (tmp_path / "spec.json", ["/ip4/127.0.0.1/tcp/1/p2p/Qm"])
    swarm._spawn(0, 0)
    swarm._spawn(1, 2, restarted=True)
    first, restarted = spawned
    assert first[first.index("--wait-for-peers") + 1] == "3"
    assert "--wait-for-peers" not in restarted  # its stage is training already: it joins a live run

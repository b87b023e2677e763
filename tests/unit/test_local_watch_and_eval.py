"""`swarm-node local` without processes: the progress bar while the swarm trains, what
becomes of a node that dies, and the final evaluation of the collected weights (which
paths, on which device, in what parts, and how an interruption stops it)."""

import asyncio
import logging
import threading
import time

import pytest
import torch

from swarm_node import __version__
from swarm_node.data.spec import DataSpec
from swarm_node.local import evaluation as local_eval
from swarm_node.local import procs as local_procs
from swarm_node.local import swarm as local
from swarm_node.local.evaluation import (
    EvaluationStopped,
    FinalEvaluation,
    in_daemon_thread,
    plan_paths,
    rows_that_fit,
)
from swarm_node.model.config import model_config
from swarm_node.model.stages import build_stage
from swarm_node.spec import RunSpec
from swarm_node.train.evaluate import BatchParts, path_val_loss
from swarm_node.wire.records import PeerRecord

DATA = DataSpec(kind="synthetic", order=1, num_tokens=20_000)


class FakeProcess:
    """A node that runs for ``polls`` polls, then exits with ``code``."""

    def __init__(self, polls: int, code: int = 0):
        self.polls, self.pid, self.code = polls, 0, code

    def poll(self):
        self.polls -= 1
        return None if self.polls >= 0 else self.code


@pytest.fixture
def no_reaping(monkeypatch):
    """FakeProcess has pid 0: killpg(0) would hit the test's own process group."""
    monkeypatch.setattr(local_procs, "reap_group", lambda pgid: None)


def test_the_bar_shows_no_loss_before_the_last_stage_reports_one(tmp_path, monkeypatch, capsys, no_reaping):
    spec = RunSpec(run_id="watch", num_stages=1, seq_len=16, data=DATA)
    swarm = local.LocalSwarm(spec, local.LocalConfig(replicas=1, steps=10, run_dir=tmp_path))
    swarm.children = [local.Child(0, 0, FakeProcess(polls=2), tmp_path / "node.log")]

    async def records(dht):  # training, but no loss yet
        return {0: [PeerRecord(stage=0, spec_hash=spec.spec_hash(), version=__version__, inner_step=4,
                               loss=None)]}

    monkeypatch.setattr(swarm, "_records", records)
    asyncio.run(swarm._watch(None, 0.0))
    err = capsys.readouterr().err
    assert "nan" not in err and "10/10" in err  # the bar ends where stage 0 did


def _two_by_two(tmp_path):
    spec = RunSpec(run_id="eval", num_stages=2, seq_len=16,
                   data=DataSpec(kind="synthetic", num_tokens=120_000))
    swarm = local.LocalSwarm(spec,
                             local.LocalConfig(replicas=2, eval_batches=2, eval_threads=2, run_dir=tmp_path,
                                               progress=False))
    swarm.preflight()
    config = model_config("debug", vocab_size=swarm.data.vocab_size, max_seq_len=16)
    weights = {s: {r: build_stage(config, num_stages=2, stage_index=s,
                                  seed=r + 1).state_dict() for r in range(2)}
               for s in range(2)}
    return spec, swarm, weights


def _evaluation(spec, swarm, stop=None, threads=2) -> FinalEvaluation:
    return FinalEvaluation(spec, swarm.data, device="cpu", batch_size=64, max_batches=2, threads=threads,
                           progress=False, stop=stop or threading.Event())


def test_the_final_evaluation_logs_each_path_and_uses_its_threads(tmp_path, monkeypatch, caplog):
    spec, swarm, weights = _two_by_two(tmp_path)
    threads = []

    def counting(*args, **kwargs):
        threads.append(torch.get_num_threads())
        return path_val_loss(*args, **kwargs)

    monkeypatch.setattr(local_eval, "path_val_loss", counting)
    try:
        with caplog.at_level(logging.INFO, logger="swarm_node.local"):
            result = _evaluation(spec, swarm).run(weights, plan_paths(2, 2, weights, {}))
    finally:
        torch.set_num_threads(1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(
        "evaluating 4 model paths (the initial weights, 2 replicas, the consensus model) "
        "on 2 validation batches of 64 windows with 2 torch threads"
    )
    assert [line.split(":")[0] for line in lines[1:]] == [
        "evaluated the initial weights (1 of 4)", "evaluated replica 0 (2 of 4)",
        "evaluated replica 1 (3 of 4)",
        "evaluated the consensus model (4 of 4)"]
    assert threads == [2, 2, 2, 2]
    assert result["final_consensus_val_loss"] is not None and result["initial_val_loss"] > 0
    assert result["eval_device"] == "cpu" and result["evaluation_skipped"] == []


def test_paths_that_need_a_dead_nodes_weights_are_skipped_and_say_why():
    weights = {0: {0: {}, 1: {}}, 1: {0: {}}}  # stage 1 replica 1 died and left nothing
    dead = {(1, 1): "stage 1 replica 1 (pid 7) died with exit code -9"}
    plan = plan_paths(2, 2, weights, dead)
    assert plan.replicas == [0] and not plan.consensus and plan.initial
    assert plan.skipped == ["replica 1: stage 1 replica 1 (pid 7) died with exit code -9",
                            "the consensus model: stage 1 replica 1 (pid 7) died with exit code -9"]
    lost = plan_paths(2, 2, weights, {})  # killed by the chaos plan: its replica goes, the consensus stays
    assert (
        lost.replicas == [0]
        and lost.consensus
        and lost.skipped == ["replica 1: stage 1 replica 1 left no weights"]
    )


def test_a_stage_whose_nodes_all_died_leaves_nothing_to_evaluate(tmp_path, monkeypatch):
    """The issue's case: the only node of a model too big for its card exited 2; evaluating
    the initial weights of that model on the CPU instead took minutes and was no use."""
    oom = "stage 0 replica 0 (pid 9) died with exit code 2"
    plan = plan_paths(1, 1, {0: {}}, {(0, 0): oom})
    assert plan.replicas == [] and not plan.consensus and not plan.initial
    assert plan.skipped[0] == f"stage 0: no node of it finished ({oom})"
    spec = RunSpec(run_id="dead", num_stages=1, seq_len=16, data=DATA)
    swarm = local.LocalSwarm(spec, local.LocalConfig(replicas=1, run_dir=tmp_path))
    swarm.preflight()
    monkeypatch.setattr(local_eval, "build_stage", lambda *a, **k: pytest.fail("a model was built"))
    result = _evaluation(spec, swarm).run({0: {}}, plan)
    assert result["final_val_loss"] is None and result["initial_val_loss"] is None
    assert result["evaluation_skipped"] == plan.skipped


def test_a_set_stop_event_ends_the_evaluation_at_the_next_batch(tmp_path):
    spec, swarm, weights = _two_by_two(tmp_path)
    stop = threading.Event()
    evaluation = _evaluation(spec, swarm, stop, threads=1)
    batches = []
    original = evaluation._batch_done

    def batch_done(progress):
        batches.append(1)
        stop.set()  # as Ctrl-C does from the event loop's thread
        original(progress)

    evaluation._batch_done = batch_done
    with pytest.raises(EvaluationStopped):
        evaluation.run(weights, plan_paths(2, 2, weights, {}))
    assert len(batches) == 1


def test_an_interrupted_run_does_not_wait_for_its_evaluation_thread():
    """A batch of a big model on the CPU can take minutes: cancelling the await returns at once."""
    release = threading.Event()

    async def scenario():
        waiting = asyncio.ensure_future(in_daemon_thread(release.wait, 60))
        await asyncio.sleep(0)  # the thread starts
        began = time.monotonic()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return time.monotonic() - began

    try:
        assert asyncio.run(scenario()) < 1.0
    finally:
        release.set()


def test_batches_are_split_into_parts_that_fit_and_halved_on_out_of_memory(tmp_path):
    _, swarm, _ = _two_by_two(tmp_path)
    config = model_config("debug", vocab_size=swarm.data.vocab_size, max_seq_len=16)
    path = [build_stage(config, num_stages=2, stage_index=s, seed=1) for s in range(2)]
    whole = path_val_loss(path, swarm.data, batch_size=64, max_batches=2)
    parts = BatchParts(rows=10)
    assert path_val_loss(path, swarm.data, batch_size=64, max_batches=2, parts=parts) == pytest.approx(
        whole, rel=1e-5
    )
    forward = path[0].forward

    def small_card(inputs, targets=None, **kwargs):
        if len(inputs) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return forward(inputs, targets, **kwargs)

    path[0].forward = small_card
    parts = BatchParts(rows=64)
    assert path_val_loss(path, swarm.data, batch_size=64, max_batches=2, parts=parts) == pytest.approx(
        whole, rel=1e-5
    )
    assert parts.rows == 2  # 64, 32, ..., 4 did not fit


def test_parts_fit_half_the_free_memory_of_a_card(monkeypatch):
    config = model_config("small", vocab_size=256, max_seq_len=1024)
    assert rows_that_fit(config, 1024, 64, torch.device("cpu")) is None  # the CPU takes whole batches
    per_window = 1024 * (32 * 768 + 8 * 2048)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * per_window, 80 << 30))
    assert rows_that_fit(config, 1024, 64, torch.device("cuda")) == 5
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (per_window, 80 << 30))
    assert rows_that_fit(config, 1024, 64, torch.device("cuda")) == 1


def test_a_node_that_exits_non_zero_is_dead_and_named(tmp_path, no_reaping, caplog):
    log = tmp_path / "node.log"
    log.write_text(
        "starting\nswarm-node join: error: out of memory on cuda:0 (H100, 79.2 GiB in all) training ...\n"
    )
    dead, chaos, stopped, done = (local.Child(s, 0, FakeProcess(0, code), log) for s, code in
                                  ((0, 2), (1, -9), (1, -15), (0, 0)))
    chaos.killed_on_purpose = True
    with caplog.at_level(logging.INFO, logger="swarm_node.local"):
        local_procs.poll([dead, chaos, done])
        local_procs.poll([stopped], stopping=True)
    assert [c.status for c in (dead, chaos, stopped, done)] == ["dead", "lost", "lost", "finished"]
    assert dead.death() == (
        "stage 0 replica 0 (pid 0) died with exit code 2: swarm-node join: error: out of memory "
        "on cuda:0 (H100, 79.2 GiB in all) training ..."
    )
    assert any(r.levelname == "ERROR" and "died with exit code 2" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("dying_stage", [0, 1])
def test_the_run_stops_when_every_node_of_a_stage_has_died(tmp_path, caplog, no_reaping, dying_stage):
    spec = RunSpec(run_id="watch", num_stages=2, seq_len=16, data=DATA)
    swarm = local.LocalSwarm(spec, local.LocalConfig(replicas=2, steps=10, run_dir=tmp_path, progress=False))
    swarm.children = [local.Child(s, r, FakeProcess(polls=1 if s == dying_stage else 10**6, code=2),
                                  tmp_path / "node.log") for s in range(2) for r in range(2)]

    async def records(dht):
        return {}

    swarm._records = records
    with caplog.at_level(logging.INFO, logger="swarm_node.local"):
        asyncio.run(asyncio.wait_for(swarm._watch(None, 0.0), 10))
    messages = [r.getMessage() for r in caplog.records]
    assert f"every node of stage {dying_stage} has died; stopping" in messages
    assert not any("has done its" in m for m in messages)  # a dead driver is not done


def test_the_exit_status_fails_a_run_with_a_dead_node():
    fine = {"dead_nodes": [], "final_val_loss": 2.0}
    assert local.local_exit_status(fine) == 0
    assert local.local_exit_status({**fine, "dead_nodes": ["stage 1 replica 1 (pid 7) died ..."]}) == 1
    assert local.local_exit_status({**fine, "final_val_loss": None}) == 1


def test_nodes_crowding_few_cores_get_longer_to_reach_the_bootstrap(tmp_path, monkeypatch):
    spec = RunSpec(model_size="debug", num_stages=2, data=DATA)
    monkeypatch.setattr(local, "usable_cores", lambda: 2.0)
    few = local.LocalSwarm(spec, local.LocalConfig(replicas=2, run_dir=tmp_path))
    assert few.startup_timeout_s() == local.DEFAULT_STARTUP_TIMEOUT_S  # the demo: the join's own default
    crowd = local.LocalSwarm(spec, local.LocalConfig(replicas=16, run_dir=tmp_path))
    assert (
        crowd.startup_timeout_s()
        == 32 / 2 * local.STARTUP_S_PER_NODE_A_CORE
        > local.DEFAULT_STARTUP_TIMEOUT_S
    )
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


def test_compile_is_passed_on_to_every_node(tmp_path, monkeypatch):
    spec = RunSpec(model_size="debug", num_stages=2, data=DATA)
    spawned = []
    monkeypatch.setattr(local.subprocess, "Popen", lambda cmd, **kw: spawned.append(cmd) or FakeProcess(0))
    for compiled in (False, True):
        swarm = local.LocalSwarm(spec,
                                 local.LocalConfig(replicas=1, run_dir=tmp_path, compile_stage=compiled))
        swarm._spawn_args = (tmp_path / "spec.json", ["/ip4/127.0.0.1/tcp/1/p2p/Qm"])
        swarm._spawn(1, 0)
    assert ["--compile" in cmd for cmd in spawned] == [False, True]


def test_a_device_that_is_not_there_is_refused_before_anything_starts(tmp_path):
    from swarm_node.errors import ConfigError

    spec = RunSpec(model_size="debug", num_stages=1, data=DATA)
    swarm = local.LocalSwarm(spec, local.LocalConfig(replicas=1, run_dir=tmp_path, device="cuda:7"))
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(ConfigError, match="cuda:7"):
        swarm.preflight()

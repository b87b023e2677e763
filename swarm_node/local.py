"""``swarm-node local``: a whole swarm on this machine.

Starts a bootstrap DHT in this process, S x R node processes on loopback (each a real
``swarm-node join``), shows one progress bar with the swarm's loss and tokens/s, and
when the stage-0 nodes have done their steps stops the rest, collects every peer's
final weights, evaluates, and writes a JSON summary. A node that dies is reported and
the others carry on. Everything that can be checked before a process starts (the run
spec, the data, the checkpoint directory) is checked first."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from swarm_node.data.dataset import TokenWindows, load_windows
from swarm_node.errors import ConfigError, SwarmError
from swarm_node.membership.registry import read_registry
from swarm_node.model.config import model_config
from swarm_node.model.stages import build_stage
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.reaper import daemon_sockets, remove_if_unused
from swarm_node.node_config import DEFAULT_STARTUP_TIMEOUT_S, check_compute_share
from swarm_node.obs.progress import EvaluationProgress, TrainingProgress
from swarm_node.spec import RunSpec
from swarm_node.state.checkpoint import PREFIX as CHECKPOINT_PREFIX
from swarm_node.system import default_threads, usable_cores
from swarm_node.train.evaluate import average_into, path_val_loss, val_batch_count, weight_spread
from swarm_node.wire.records import PeerRecord

# Every node of a local swarm imports torch and starts its DHT at the same moment, on
# this machine's cores, while the bootstrap has to answer them all: 32 nodes on 2 cores
# took minutes to reach it, and at the join's own default (60 s) 10 to 26 of them gave
# up ("none of the initial peers answered"). So each node gets this long a core it shares.
STARTUP_S_PER_NODE_A_CORE = 15.0

log = logging.getLogger("swarm_node.local")


@dataclass(frozen=True)
class ChaosPlan:
    """Fault injection for `swarm-node local`: SIGKILL ``kills`` random nodes (their whole
    process group, as a machine dying would) at random moments while stage 0 is
    between ``window`` fractions of its steps, and start ``restarts`` of them again
    from their checkpoints ``restart_delay_s`` later."""
    kills: int = 0
    restarts: int = 0
    seed: int = 0
    window: tuple[float, float] = (0.15, 0.5)
    restart_delay_s: float = 2.0


@dataclass(frozen=True)
class LocalConfig:
    replicas: int = 2
    steps: int = 200
    device: str = "cpu"
    threads_per_node: int = 1
    compute_share: float = 1.0  # each node computes at most this share of the time (--compute-share)
    round_timeout_s: float = 15.0
    blocking_rounds: bool = False
    eval_batches: int = 8
    eval_batch_size: int = 64
    run_dir: Path | None = None  # keep node logs, weights and summaries here (default: a temp dir, removed)
    progress: bool = True
    stop_grace_s: float = 30.0
    dashboard_port: int | None = None  # run a real swarm-bootstrap with its dashboard here (0: any port)
    chaos: ChaosPlan | None = None
    checkpoint_dir: Path | None = None  # every node writes checkpoints to its own sub-directory of this
    eval_threads: int | None = None  # torch threads of the final evaluation (default: the cores free then)

    def __post_init__(self) -> None:
        check_compute_share(self.compute_share)


@dataclass
class Child:
    stage: int
    replica: int
    process: subprocess.Popen
    log_path: Path
    returncode: int | None = None
    status: str = "running"
    restarted: bool = False  # started again from its checkpoint after being killed


@dataclass
class SwarmResult:
    summary: dict
    children: list[Child] = field(default_factory=list)


class LocalSwarm:
    def __init__(self, spec: RunSpec, config: LocalConfig):
        self.spec = spec
        self.config = config
        self.keep_dir = config.run_dir is not None
        self.run_dir = Path(config.run_dir) if config.run_dir else Path(tempfile.mkdtemp(prefix="swarm-local-"))
        self.children: list[Child] = []
        self._dashboard: subprocess.Popen | None = None  # the swarm-bootstrap of --dashboard-port
        self._dashboard_dir: Path | None = None
        self._spawn_args: tuple[Path, list[str]] | None = None
        self._kills: list[tuple[float, tuple[int, int]]] = []  # (fraction of steps, (stage, replica))
        self._restarts: list[tuple[float, tuple[int, int]]] = []  # (monotonic time, (stage, replica))
        self._to_restart: set[tuple[int, int]] = set()
        self.loss_curve: list[tuple[int, float]] = []
        self.data: TokenWindows | None = None  # loaded before any process starts, evaluated on at the end

    def node_checkpoint_dir(self, stage: int, replica: int) -> Path | None:
        """Where the node writes its checkpoints: under --checkpoint-dir, or in the run dir when
        chaos may restart it (it resumes from there), or nowhere."""
        if self.config.checkpoint_dir is not None:
            return Path(self.config.checkpoint_dir) / f"stage{stage}-r{replica}"
        if self.config.chaos is not None:
            return self.run_dir / f"checkpoints-s{stage}-r{replica}"
        return None

    def preflight(self) -> None:
        """Refuse what would make the nodes fail, before any process or daemon starts: the
        spec itself was checked when it was built; here the data and the checkpoint dirs."""
        try:
            self.data = load_windows(self.spec.data, self.spec.seq_len)
        except (OSError, ValueError, ImportError) as exc:
            raise ConfigError(f"the data {self.spec.data.describe()} cannot be loaded: {exc}; check --data") from None
        if self.config.checkpoint_dir is not None:
            used = [d for s in range(self.spec.num_stages) for r in range(self.config.replicas)
                    if (d := self.node_checkpoint_dir(s, r)).is_dir() and any(d.glob(f"{CHECKPOINT_PREFIX}*"))]
            if used:
                raise ConfigError(f"--checkpoint-dir {self.config.checkpoint_dir} already holds checkpoints of an "
                                  f"earlier run ({used[0]}); a new local run cannot continue them: give a new or "
                                  "empty directory")

    async def run(self) -> dict:
        started = time.perf_counter()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        sockets_before = daemon_sockets()
        try:
            self.preflight()
            spec_path = self.run_dir / "run-spec.json"
            self.spec.write_json(spec_path)
            initial = [await self._start_dashboard(spec_path)] if self.config.dashboard_port is not None else []
            dht = await SwarmDHT.start(initial_peers=initial)
            try:
                maddrs = [*initial, dht.visible_maddrs()[0]]
                log.info("bootstrap DHT at %s; run dir %s", maddrs[0], self.run_dir)
                self._plan_chaos()
                self._spawn_all(spec_path, maddrs)
                await self._watch(dht, started)
            finally:  # also on Ctrl-C: no node outlives the swarm
                self._stop_all()
                await dht.shutdown()
            return await asyncio.to_thread(self._collect, time.perf_counter() - started)
        finally:
            self._stop_dashboard()
            remove_stale_sockets(sockets_before)
            if not self.keep_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- processes ----------------------------------------------------------------
    async def _start_dashboard(self, spec_path: Path) -> str:
        """A real ``swarm-bootstrap`` (the program hosts run) serving this swarm's
        dashboard; returns its multiaddr. Its identity lives in a temporary directory."""
        self._dashboard_dir = Path(tempfile.mkdtemp(prefix="swarm-local-bootstrap-"))
        out = self._dashboard_dir / "bootstrap.out"
        with open(out, "wb") as stdout, open(self.run_dir / "bootstrap.log", "wb") as stderr:
            self._dashboard = subprocess.Popen(
                [sys.executable, "-m", "swarm_bootstrap", "--identity", str(self._dashboard_dir / "identity.key"),
                 "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--http-host", "127.0.0.1",
                 "--http-port", str(self.config.dashboard_port), "--run-spec", str(spec_path),
                 "--no-reachability-check"], stdout=stdout, stderr=stderr, start_new_session=True)
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and self._dashboard.poll() is None:
            lines = out.read_text().splitlines()
            maddr = [ln.split()[-1] for ln in lines if ln.strip().startswith("swarm-node join --initial-peers")]
            url = [ln.split()[1] for ln in lines if ln.startswith("dashboard: ")]
            if maddr and url:
                log.info("dashboard: %s", url[0])
                return maddr[0]
            await asyncio.sleep(0.2)  # polling the bootstrap's output for its address
        raise SwarmError(f"the dashboard's bootstrap did not start; see {self.run_dir / 'bootstrap.log'}")

    def _stop_dashboard(self) -> None:
        process = self._dashboard
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=self.config.stop_grace_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            _reap_group(process.pid)
        if self._dashboard_dir is not None:
            shutil.rmtree(self._dashboard_dir, ignore_errors=True)

    def startup_timeout_s(self) -> float:
        """How long a node may take to reach the bootstrap: the join's default, or more
        where many nodes share few cores."""
        nodes = self.spec.num_stages * self.config.replicas
        return max(DEFAULT_STARTUP_TIMEOUT_S, STARTUP_S_PER_NODE_A_CORE * nodes / max(1.0, usable_cores()))

    def _spawn_all(self, spec_path: Path, maddrs: list[str]) -> None:
        self._spawn_args = (spec_path, maddrs)
        for stage in range(self.spec.num_stages):
            for replica in range(self.config.replicas):
                self._spawn(stage, replica)

    def _spawn(self, stage: int, replica: int, restarted: bool = False) -> Child:
        spec_path, maddrs = self._spawn_args
        env = dict(os.environ, OMP_NUM_THREADS=str(self.config.threads_per_node), PYTHONUNBUFFERED="1")
        suffix = "-restarted" if restarted else ""
        log_path = self.run_dir / f"node-s{stage}-r{replica}{suffix}.log"
        cmd = [sys.executable, "-m", "swarm_node", "join", "--initial-peers", *maddrs,
               "--config", str(spec_path), "--stage", str(stage), "--device", self.config.device,
               "--threads", str(self.config.threads_per_node), "--run-dir", str(self.run_dir),
               "--round-timeout", str(self.config.round_timeout_s), "--no-progress",
               "--startup-timeout", str(self.startup_timeout_s()),
               "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]  # one machine: loopback, any free port
        if self.config.blocking_rounds:
            cmd.append("--blocking-rounds")
        if self.config.compute_share < 1:
            cmd += ["--compute-share", str(self.config.compute_share)]
        if not restarted:  # everyone starts together; a restarted node may need to catch up with its stage
            cmd += ["--no-state-download", "--wait-for-peers", str(self.config.replicas)]
        if stage == 0:
            cmd += ["--max-steps", str(self.config.steps), "--data-shard", f"{replica}/{self.config.replicas}"]
        if self.config.chaos is not None:  # a node that may be restarted keeps its identity and state
            cmd += ["--identity", str(self.run_dir / f"identity-s{stage}-r{replica}.key"),
                    "--checkpoint-dir", str(self.node_checkpoint_dir(stage, replica))]
        elif self.config.checkpoint_dir is not None:
            cmd += ["--checkpoint-dir", str(self.node_checkpoint_dir(stage, replica))]
        with open(log_path, "wb") as out:
            process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        child = Child(stage, replica, process, log_path, restarted=restarted)
        self.children.append(child)
        return child

    # -- fault injection ------------------------------------------------------------
    def _plan_chaos(self) -> None:
        plan = self.config.chaos
        if plan is None or plan.kills == 0:
            return
        rng = random.Random(plan.seed)
        nodes = [(s, r) for s in range(self.spec.num_stages) for r in range(self.config.replicas)]
        targets = rng.sample(nodes, min(plan.kills, len(nodes)))
        moments = sorted(rng.uniform(*plan.window) for _ in targets)
        self._kills = list(zip(moments, targets))
        self._to_restart = set(targets[: plan.restarts])

    def _inject_faults(self, stage0_step: int | None) -> None:
        now = time.monotonic()
        while self._kills and stage0_step is not None and stage0_step >= self._kills[0][0] * self.config.steps:
            _, (stage, replica) = self._kills.pop(0)
            victim = next((c for c in self.children if (c.stage, c.replica) == (stage, replica)
                           and c.process.poll() is None), None)
            if victim is None:
                continue
            log.warning("chaos: killing node stage %d replica %d (pid %d) at stage-0 step %d", stage, replica,
                        victim.process.pid, stage0_step)
            _reap_group(victim.process.pid)  # SIGKILL to its whole process group
            if (stage, replica) in self._to_restart:
                self._restarts.append((now + self.config.chaos.restart_delay_s, (stage, replica)))
        while self._restarts and self._restarts[0][0] <= now:
            _, (stage, replica) = self._restarts.pop(0)
            child = self._spawn(stage, replica, restarted=True)
            log.warning("chaos: restarted node stage %d replica %d from its checkpoint (pid %d)", stage, replica,
                        child.process.pid)

    def _poll_children(self) -> None:
        for child in self.children:
            if child.returncode is None:
                code = child.process.poll()
                if code is not None:
                    child.returncode = code
                    _reap_group(child.process.pid)
                    if code != 0:
                        child.status = "lost"
                        tail = child.log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
                        log.warning("node stage %d replica %d (pid %d) died with exit code %d: %s", child.stage,
                                    child.replica, child.process.pid, code, tail[0][:200])
                    else:
                        child.status = "finished"

    async def _watch(self, dht: SwarmDHT, started: float) -> None:
        bar = TrainingProgress(self.config.steps, "swarm", enabled=self.config.progress)
        try:
            while True:
                self._poll_children()
                drivers = [c for c in self.children if c.stage == 0]
                if all(c.returncode is not None for c in drivers) and not self._restarts:
                    if any(c.returncode == 0 for c in drivers):  # a driver exits cleanly after its last step
                        bar.finish(self.config.steps)
                    bar.close()
                    log.info("stage 0 has done its %d steps; stopping the other nodes", self.config.steps)
                    return
                if all(c.returncode is not None and c.returncode != 0 for c in self.children if c.stage > 0) \
                        and self.spec.num_stages > 1:
                    log.error("every node of the later stages has died; stopping")
                    return
                records = await self._records(dht)
                step = min((r.inner_step for r in records.get(0, []) if r.state == "training"), default=None)
                self._inject_faults(step)
                tokens = sum(r.tokens for r in records.get(0, []))
                losses = [r.loss for r in records.get(self.spec.num_stages - 1, []) if r.loss is not None]
                if losses:
                    self.loss_curve.append((tokens, float(np.mean(losses))))
                if step is not None:
                    last_loss = self.loss_curve[-1][1] if self.loss_curve else None  # none before the first
                    bar.update(min(step, self.config.steps), tokens, last_loss, None, time.perf_counter() - started)
                await asyncio.sleep(0.5)
        finally:
            bar.close()

    async def _records(self, dht: SwarmDHT) -> dict[int, list[PeerRecord]]:
        try:
            async with asyncio.timeout(2 * self.spec.num_stages):
                records, _ = await read_registry(dht, self.spec.run_id, self.spec.num_stages,  # refused: not shown
                                                   self.spec.registry_shards)
        except TimeoutError:
            return {}
        out: dict[int, list[PeerRecord]] = {}
        for record in records.values():
            out.setdefault(record.stage, []).append(record)
        return out

    def _stop_all(self) -> None:
        """SIGTERM whoever is still running, then SIGKILL after the grace period."""
        running = [c for c in self.children if c.process.poll() is None]
        for child in running:
            child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_grace_s
        for child in running:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("node pid %d ignored SIGTERM; killing it", child.process.pid)
                os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()
        self._poll_children()
        for child in self.children:
            _reap_group(child.process.pid)
            if child.returncode is not None and child.returncode != 0 and child.status != "lost":
                child.status = "lost"

    # -- results ------------------------------------------------------------------
    def _collect(self, wall_s: float) -> dict:
        summaries = {}
        for path in self.run_dir.glob("summary-*.json"):
            data = json.loads(path.read_text())
            summaries[data["pid"]] = data
        peers, stage_weights = [], {s: {} for s in range(self.spec.num_stages)}
        for child in self.children:
            info = summaries.get(child.process.pid)
            status = child.status if info is None or child.status == "lost" else "finished"
            entry = {"peer_id": None, "stage": child.stage, "pid": child.process.pid, "status": status,
                     "restarted": child.restarted, "resumed_from_step": None,
                     "inner_steps": 0, "outer_rounds": 0, "rounds_with_partner": 0, "local_only_rounds": 0,
                     "bytes_sent": 0, "bytes_received": 0, "microbatches_done": 0, "microbatches_lost": 0,
                     "retries": 0}
            checkpoints = self.node_checkpoint_dir(child.stage, child.replica)
            written = self.config.checkpoint_dir is not None and any(checkpoints.glob(f"{CHECKPOINT_PREFIX}*"))
            entry["checkpoint_dir"] = str(checkpoints) if written else None  # where `export` finds this node
            if info is not None:
                entry.update({k: info[k] for k in entry if k in info and k not in ("status", "pid", "restarted")})
                weights = self.run_dir / info["weights_file"]
                if weights.exists():
                    stage_weights[child.stage][child.replica] = torch.load(weights, map_location="cpu")
            peers.append(entry)
        began = time.perf_counter()
        evaluation = self._evaluate(stage_weights)
        evaluation["eval_s"] = time.perf_counter() - began
        tokens = sum(p["microbatches_done"] for p in peers if p["stage"] == 0) * self.spec.batch_size \
            * self.spec.seq_len
        final = evaluation["final_val_loss"]
        return {**evaluation, "peers": peers, "wall_s": wall_s, "tokens": tokens,
                "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
                # Validation needs every peer's weights, which are collected at the end; the
                # curve during the run is the training loss of the last stage (below).
                "val_loss_curve": [[0, evaluation["initial_val_loss"]]] + ([[tokens, final]] if final else []),
                "train_loss_curve": [[int(t), v] for t, v in self.loss_curve],
                "run_spec_hash": self.spec.spec_hash(), "method": self.spec.method.name}

    def _evaluate(self, stage_weights: dict[int, dict[int, dict]]) -> dict:
        """Validation loss of the initial model, of every replica's path (replica r at every
        stage) and of the consensus model (each stage the mean of its replicas)."""
        data = self.data if self.data is not None else load_windows(self.spec.data, self.spec.seq_len)
        config = model_config(self.spec.model_size, vocab_size=data.vocab_size, max_seq_len=self.spec.seq_len)

        def stage_module(stage: int, state: dict | None):
            module = build_stage(config, num_stages=self.spec.num_stages, stage_index=stage, seed=self.spec.seed,
                                 layers_per_stage=self.spec.layers_per_stage)
            if state is not None:
                module.load_state_dict(state)
            return module

        stages = range(self.spec.num_stages)
        replicas = [r for r in range(self.config.replicas) if all(r in stage_weights[s] for s in stages)]
        complete = all(stage_weights[s] for s in stages)
        batches = val_batch_count(data, self.config.eval_batch_size, self.config.eval_batches)
        threads = self.config.eval_threads or default_threads()  # measured now: our nodes have stopped
        log.info("evaluating %d model paths (the initial weights, %d replicas%s) on %d validation batch%s of %d "
                 "windows with %d torch thread%s", 1 + len(replicas) + complete, len(replicas),
                 ", the consensus model" if complete else "", batches, "es" if batches > 1 else "",
                 self.config.eval_batch_size, threads, "s" if threads > 1 else "")
        progress = EvaluationProgress(1 + len(replicas) + complete, batches, log, enabled=self.config.progress)

        def evaluate(what: str, path: list) -> float:
            progress.start(what)
            began = time.perf_counter()
            loss = path_val_loss(path, data, batch_size=self.config.eval_batch_size,
                                 max_batches=self.config.eval_batches, on_batch=progress.advance)
            progress.finished(what, loss, time.perf_counter() - began)
            return loss

        # Set in this (worker) thread, which does all the work: OpenMP keeps a thread count per
        # OS thread; the previous count is restored afterwards.
        threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            initial = evaluate("the initial weights", [stage_module(s, None) for s in stages])
            modules = {s: {r: stage_module(s, w) for r, w in ws.items()} for s, ws in stage_weights.items()}
            losses = [evaluate(f"replica {r}", [modules[s][r] for s in stages]) for r in replicas]
            consensus = evaluate("the consensus model", [average_into(stage_module(s, None),
                                                                      list(modules[s].values())) for s in stages]) \
                if complete else None
        finally:
            progress.close()
            torch.set_num_threads(threads_before)
        final = float(np.mean(losses)) if losses else consensus
        return {"initial_val_loss": initial, "final_val_loss": final, "final_consensus_val_loss": consensus,
                "replica_weight_std": [weight_spread(list(modules[s].values())) for s in stages],
                "entropy_floor": data.entropy_floor}


def remove_stale_sockets(existing_before: set[Path]) -> None:
    """A node killed hard leaves its daemon's unix sockets behind (its reaper removes
    them too, but a whole process group killed at once takes the reaper along). Remove
    those created during this run that nothing listens on any more; anything still
    listening, such as another swarm on this machine, is left alone."""
    for path in daemon_sockets() - existing_before:
        remove_if_unused(path)


def _reap_group(pgid: int) -> None:
    """A node killed hard cannot stop its DHT child or p2pd; each node runs in its own
    session, so kill whatever is left of its process group."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_local(spec: RunSpec, config: LocalConfig, json_out: Path | None) -> dict:
    swarm = LocalSwarm(spec, config)
    # SIGTERM takes the Ctrl-C path: the nodes are stopped and the run dir removed.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        summary = asyncio.run(swarm.run())
    finally:
        signal.signal(signal.SIGTERM, previous)
    lost = [p for p in summary["peers"] if p["status"] == "lost"]
    consensus = summary["final_consensus_val_loss"]
    log.info("swarm: final val loss %s%s, %s tokens in %.1f s (%.0f tok/s), evaluated in %.1f s; %d of %d peers lost",
             f"{summary['final_val_loss']:.4f}" if summary["final_val_loss"] is not None else "n/a",
             f" (consensus model {consensus:.4f})" if consensus is not None else "",
             f"{summary['tokens']:,}", summary["wall_s"], summary["tokens_per_s"] or 0, summary["eval_s"], len(lost),
             len(summary["peers"]))
    for p in summary["peers"]:
        log.info("  stage %d %s pid %d: %s, %d steps, %d rounds (%d with a partner), %d micro-batches, %d lost",
                 p["stage"], (p["peer_id"] or "?")[-6:], p["pid"], p["status"], p["inner_steps"], p["outer_rounds"],
                 p["rounds_with_partner"], p["microbatches_done"], p["microbatches_lost"])
    log.info(export_hint(summary, config))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(summary, indent=2) + "\n")
        log.info("wrote %s", json_out)
    return summary


def export_hint(summary: dict, config: LocalConfig) -> str:
    """How to turn the nodes' checkpoints into one model (or how to keep them next time)."""
    if config.checkpoint_dir is None:
        return "the trained weights are not kept: run with --checkpoint-dir DIR to export a model afterwards"
    dirs = [p["checkpoint_dir"] for p in sorted(summary["peers"], key=lambda p: p["stage"]) if p.get("checkpoint_dir")]
    if not dirs:
        return f"no node wrote a checkpoint under {config.checkpoint_dir}"
    return ("export the model (the replicas of each stage averaged; give one directory per stage for a single "
            f"replica's model): swarm-node export --checkpoint {' '.join(dict.fromkeys(dirs))} --out MODEL_DIR")

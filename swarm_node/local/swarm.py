"""``swarm-node local``: a whole swarm on this machine.

Starts a bootstrap DHT in this process, S x R node processes on loopback (each a real
``swarm-node join``), shows one progress bar with the swarm's loss and tokens/s, and
when the stage-0 nodes have done their steps stops the rest, collects every peer's
final weights, evaluates them on the run's device (local/evaluation.py), and writes a JSON
summary (local/summary.py). A node that dies is named (local/procs.py) and the others carry on; the run
then fails, and what needs the dead node's weights is not evaluated. Everything that
can be checked before a process starts (the run spec, the data, the checkpoint
directory) is checked first. Ctrl-C or SIGTERM, in any phase, stops every process the
run started within seconds (``LocalConfig.interrupt_grace_s``)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from swarm_node.config import resolve_device
from swarm_node.data.dataset import TokenWindows, load_windows
from swarm_node.errors import ConfigError, SwarmError
from swarm_node.local.chaos import ChaosPlan, ChaosSchedule
from swarm_node.local.config import LocalConfig
from swarm_node.local.evaluation import EvaluationStopped, FinalEvaluation, in_daemon_thread, plan_paths
from swarm_node.local.procs import (
    Child,
    daemon_sockets,
    our_processes,
    poll,
    reap_group,
    remove_stale_sockets,
    stop_children,
    sweep_descendants,
)
from swarm_node.local.summary import export_hint, gather_nodes, local_exit_status, log_summary, summary_of
from swarm_node.membership.registry import read_registry
from swarm_node.net.dht import SwarmDHT
from swarm_node.node_config import DEFAULT_STARTUP_TIMEOUT_S
from swarm_node.obs.progress import TrainingProgress
from swarm_node.spec import RunSpec
from swarm_node.state.checkpoint import PREFIX as CHECKPOINT_PREFIX
from swarm_node.system import default_threads, usable_cores
from swarm_node.wire.records import PeerRecord

__all__ = ["ChaosPlan", "Child", "LocalConfig", "LocalSwarm", "daemon_sockets", "export_hint",
           "local_exit_status",
           "remove_stale_sockets", "run_local"]

# Every node of a local swarm imports torch and starts its DHT at the same moment, on
# this machine's cores, while the bootstrap has to answer them all: so a node's start-up
# deadline grows with the nodes a core serves, this long each (the join's fixed 60 s
# is too short for dozens of nodes on a few cores: docs/ARCHITECTURE.md, "Why it is
# this way").
STARTUP_S_PER_NODE_A_CORE = 15.0
# What each node process runs (after the interpreter): tests put a node with a fault of
# their choosing here (tests/swarm/local_faults.py).
NODE_PROGRAM: tuple[str, ...] = ("-m", "swarm_node")

log = logging.getLogger("swarm_node.local")


class LocalSwarm:
    def __init__(self, spec: RunSpec, config: LocalConfig):
        self.spec = spec
        self.config = config
        self.keep_dir = config.run_dir is not None
        self.run_dir = (
            Path(config.run_dir) if config.run_dir else Path(tempfile.mkdtemp(prefix="swarm-local-"))
        )
        self.children: list[Child] = []
        self._dashboard: subprocess.Popen | None = None  # the swarm-bootstrap of --dashboard-port
        self._dashboard_dir: Path | None = None
        self._spawn_args: tuple[Path, list[str]] | None = None
        self.chaos = ChaosSchedule(config.chaos, spec.num_stages, config.replicas, config.steps)
        self.loss_curve: list[tuple[int, float]] = []
        self.data: TokenWindows | None = None  # loaded before any process starts, evaluated on at the end
        self.interrupted = False  # Ctrl-C or SIGTERM: everything stops, nothing is evaluated
        self._stop_evaluation = threading.Event()

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
        spec itself was checked when it was built; here the device, the data and the checkpoint
        dirs."""
        resolve_device(self.config.device)  # ConfigError when it is not there
        try:
            self.data = load_windows(self.spec.data, self.spec.seq_len)
        except (OSError, ValueError, ImportError) as exc:
            raise ConfigError(
                f"the data {self.spec.data.describe()} cannot be loaded: {exc}; check --data"
            ) from None
        if self.config.checkpoint_dir is not None:
            used = [d for s in range(self.spec.num_stages) for r in range(self.config.replicas)
                    if (d := self.node_checkpoint_dir(s,
                                                      r)).is_dir() and any(d.glob(f"{CHECKPOINT_PREFIX}*"))]
            if used:
                raise ConfigError(
                    f"--checkpoint-dir {self.config.checkpoint_dir} already holds checkpoints of an "
                    f"earlier run ({used[0]}); a new local run cannot continue them: give a new or "
                    "empty directory"
                )

    async def run(self) -> dict:
        started = time.perf_counter()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        sockets_before, processes_before = daemon_sockets(), our_processes()
        handled = self._handle_signals(asyncio.current_task())
        try:
            self.preflight()
            spec_path = self.run_dir / "run-spec.json"
            self.spec.write_json(spec_path)
            initial = (
                [await self._start_dashboard(spec_path)] if self.config.dashboard_port is not None else []
            )
            dht = await self._start_dht(initial)
            try:
                maddrs = [*initial, dht.visible_maddrs()[0]]
                log.info("bootstrap DHT at %s; run dir %s", maddrs[0], self.run_dir)
                self._spawn_all(spec_path, maddrs)
                await self._watch(dht, started)
            finally:  # also on Ctrl-C: no node outlives the swarm
                await self._stop_swarm(dht)
            return await self._collect(time.perf_counter() - started)
        finally:
            self._stop_dashboard()
            swept = sweep_descendants(processes_before)
            if swept:
                log.warning("killed %d process%s the run left running (pids %s)", len(swept),
                            "es" if len(swept) > 1 else "", " ".join(map(str, swept)))
            remove_stale_sockets(sockets_before)
            if not self.keep_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            for sig in handled:  # last: a second signal during the clean-up finds it handled
                asyncio.get_running_loop().remove_signal_handler(sig)

    def _handle_signals(self, main: asyncio.Task) -> list[int]:
        """Ctrl-C and SIGTERM cancel the run wherever it is (start-up, training, evaluation);
        its clean-up then stops the nodes with the short grace. Returns the signals handled
        (none where the loop cannot: not the main thread, not Unix)."""
        handled = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                asyncio.get_running_loop().add_signal_handler(sig, self._interrupt, main)
            except (ValueError, RuntimeError, NotImplementedError):
                continue
            handled.append(sig)
        return handled

    def _interrupt(self, main: asyncio.Task) -> None:
        if not self.interrupted:
            log.warning("interrupted: stopping every node")
        self.interrupted = True
        self._stop_evaluation.set()
        main.cancel()

    async def _start_dht(self, initial: list[str]) -> SwarmDHT:
        """The bootstrap DHT. Interrupted while it starts (a thread and a child process that
        a cancelled await would leave running), it is given the grace to come up and is
        shut down again."""
        starting = asyncio.ensure_future(SwarmDHT.start(initial_peers=initial))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            try:
                async with asyncio.timeout(self.config.interrupt_grace_s):
                    await (await starting).shutdown()
            except Exception:  # noqa: BLE001 - interrupted anyway; what is left gets swept
                pass
            raise

    async def _stop_swarm(self, dht: SwarmDHT) -> None:
        """The nodes, then the bootstrap DHT (they may still leave through it); interrupted,
        both at once within the short grace, whatever is left is killed after."""
        if not self.interrupted:
            self._stop_all()
            await self._shutdown_dht(dht, 30.0)
            return
        await asyncio.gather(
            asyncio.to_thread(self._stop_all), self._shutdown_dht(dht, self.config.interrupt_grace_s)
        )

    async def _shutdown_dht(self, dht: SwarmDHT, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await dht.shutdown()
        except TimeoutError:
            log.warning("the bootstrap DHT did not shut down in time; its processes are killed")

    # -- processes ----------------------------------------------------------------
    async def _start_dashboard(self, spec_path: Path) -> str:
        """A real ``swarm-bootstrap`` (the program hosts run) serving this swarm's
        dashboard; returns its multiaddr. Its identity lives in a temporary directory."""
        self._dashboard_dir = Path(tempfile.mkdtemp(prefix="swarm-local-bootstrap-"))
        out = self._dashboard_dir / "bootstrap.out"
        with open(out, "wb") as stdout, open(self.run_dir / "bootstrap.log", "wb") as stderr:
            self._dashboard = subprocess.Popen(
                [sys.executable, "-m", "swarm_bootstrap", "--identity",
                 str(self._dashboard_dir / "identity.key"),
                 "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--http-host", "127.0.0.1",
                 "--http-port", str(self.config.dashboard_port), "--run-spec", str(spec_path),
                 "--no-reachability-check"], stdout=stdout, stderr=stderr, start_new_session=True)
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and self._dashboard.poll() is None:
            lines = out.read_text().splitlines()
            maddr = [
                ln.split()[-1] for ln in lines if ln.strip().startswith("swarm-node join --initial-peers")
            ]
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
                    process.wait(timeout=self._grace_s())
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            reap_group(process.pid)
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
        cmd = [sys.executable, *NODE_PROGRAM, "join", "--initial-peers", *maddrs,
               "--config", str(spec_path), "--stage", str(stage), "--device", self.config.device,
               "--threads", str(self.config.threads_per_node), "--run-dir", str(self.run_dir),
               "--round-timeout", str(self.config.round_timeout_s), "--no-progress",
               "--startup-timeout", str(self.startup_timeout_s()),
               "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]  # one machine: loopback, any free port
        if self.config.blocking_rounds:
            cmd.append("--blocking-rounds")
        if not self.config.lanes:
            cmd.append("--no-lanes")
        if self.config.compile_stage:
            cmd.append("--compile")
        if self.config.compute_share < 1:
            cmd += ["--compute-share", str(self.config.compute_share)]
        if not restarted:  # everyone starts together; a restarted node may need to catch up with its stage
            cmd += ["--no-state-download", "--wait-for-peers", str(self.config.replicas)]
        if stage == 0:
            cmd += ["--max-steps", str(self.config.steps), "--data-shard",
                    f"{replica}/{self.config.replicas}"]
        if self.config.chaos is not None:  # a node that may be restarted keeps its identity and state
            cmd += ["--identity", str(self.run_dir / f"identity-s{stage}-r{replica}.key"),
                    "--checkpoint-dir", str(self.node_checkpoint_dir(stage, replica))]
        elif self.config.checkpoint_dir is not None:
            cmd += ["--checkpoint-dir", str(self.node_checkpoint_dir(stage, replica))]
        with open(log_path, "wb") as out:
            process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                       env=env)
        child = Child(stage, replica, process, log_path, restarted=restarted)
        self.children.append(child)
        return child

    # -- fault injection ------------------------------------------------------------
    def _inject_faults(self, stage0_step: int | None) -> None:
        now = time.monotonic()
        for stage, replica in self.chaos.kills_due(stage0_step, now):
            victim = next((c for c in self.children if (c.stage, c.replica) == (stage, replica)
                           and c.process.poll() is None), None)
            if victim is None:
                continue
            log.warning("chaos: killing node stage %d replica %d (pid %d) at stage-0 step %d", stage, replica,
                        victim.process.pid, stage0_step)
            victim.killed_on_purpose = True
            reap_group(victim.process.pid)  # SIGKILL to its whole process group
        for stage, replica in self.chaos.restarts_due(now):
            child = self._spawn(stage, replica, restarted=True)
            log.warning("chaos: restarted node stage %d replica %d from its checkpoint (pid %d)", stage,
                        replica,
                        child.process.pid)

    def _poll_children(self) -> None:
        poll(self.children)

    async def _watch(self, dht: SwarmDHT, started: float) -> None:
        bar = TrainingProgress(self.config.steps, "swarm", enabled=self.config.progress)
        try:
            while True:
                self._poll_children()
                drivers = [c for c in self.children if c.stage == 0]
                if (
                    any(c.returncode == 0 for c in drivers)
                    and all(c.returncode is not None for c in drivers)
                    and not self.chaos.restarts_pending
                ):  # a driver exits cleanly after its last step
                    bar.finish(self.config.steps)
                    bar.close()
                    log.info("stage 0 has done its %d steps; stopping the other nodes", self.config.steps)
                    return
                gone = self._stages_without_nodes()
                if gone and not self.chaos.restarts_pending:
                    log.error("every node of stage %s has died; stopping", ", ".join(map(str, gone)))
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
                    bar.update(min(step, self.config.steps), tokens, last_loss, None,
                               time.perf_counter() - started)
                await asyncio.sleep(0.5)
        finally:
            bar.close()

    def _stages_without_nodes(self) -> list[int]:
        """Stages whose every node has ended without finishing (dead, or killed by chaos)."""
        ended = {(c.stage, c.replica) for c in self.children if c.returncode not in (None, 0)}
        live = {(c.stage, c.replica) for c in self.children if c.returncode is None or c.returncode == 0}
        return [s for s in range(self.spec.num_stages)
                if not any(k[0] == s for k in live) and any(k[0] == s for k in ended)]

    async def _records(self, dht: SwarmDHT) -> dict[int, list[PeerRecord]]:
        try:
            async with asyncio.timeout(2 * self.spec.num_stages):
                # refused: not shown
                records, _ = await read_registry(dht, self.spec.run_id, self.spec.num_stages,
                                                   self.spec.registry_shards)
        except TimeoutError:
            return {}
        out: dict[int, list[PeerRecord]] = {}
        for record in records.values():
            out.setdefault(record.stage, []).append(record)
        return out

    def _stop_all(self) -> None:
        """SIGTERM whoever is still running, then SIGKILL after the grace period (a short
        one when the run was interrupted)."""
        stop_children(self.children, self._grace_s())

    def _grace_s(self) -> float:
        return self.config.interrupt_grace_s if self.interrupted else self.config.stop_grace_s

    # -- results ------------------------------------------------------------------
    async def _collect(self, wall_s: float) -> dict:
        """The summary: every node's figures, then the final evaluation, in a thread of its
        own that an interruption stops between batches (and that never holds up the exit)."""
        peers, stage_weights = await in_daemon_thread(
            gather_nodes, self.children, self.run_dir, self.spec.num_stages, self.node_checkpoint_dir,
            self.config.checkpoint_dir is not None)
        dead = [c for c in self.children if c.status == "dead"]
        plan = plan_paths(self.spec.num_stages, self.config.replicas, stage_weights,
                          {(c.stage,
                            c.replica): f"{c.name()} died with exit code {c.returncode}" for c in dead})
        data = self.data if self.data is not None else load_windows(self.spec.data, self.spec.seq_len)
        evaluation = FinalEvaluation(self.spec, data, device=resolve_device(self.config.device),
                                     batch_size=self.config.eval_batch_size,
                                     max_batches=self.config.eval_batches,
                                     # our nodes have stopped
                                     threads=self.config.eval_threads or default_threads(),
                                     progress=self.config.progress, stop=self._stop_evaluation)
        began = time.perf_counter()
        result = await in_daemon_thread(evaluation.run, stage_weights, plan)
        result["eval_s"] = time.perf_counter() - began
        return summary_of(self.spec, result, peers, [c.death() for c in dead], wall_s, self.loss_curve)

def run_local(spec: RunSpec, config: LocalConfig, json_out: Path | None) -> dict:
    """Run the swarm and log its summary. KeyboardInterrupt when Ctrl-C or SIGTERM stopped it."""
    swarm = LocalSwarm(spec, config)
    # Until the event loop handles them (LocalSwarm.run), SIGTERM takes the Ctrl-C path too.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        summary = asyncio.run(swarm.run())
    except (asyncio.CancelledError, EvaluationStopped):
        if swarm.interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    log_summary(summary, config)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(summary, indent=2) + "\n")
        log.info("wrote %s", json_out)
    return summary

"""A node's checkpoints: which one to resume from at start, writing one after rounds
and on shutdown, and the last line a volunteer sees (where its progress is, and the
command that resumes it). The file format is state/checkpoint.py."""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Callable
from pathlib import Path

from swarm_node import __version__
from swarm_node.errors import ConfigError, IncompatibleRun
from swarm_node.node_services import Compute
from swarm_node.spec import RunSpec
from swarm_node.state.checkpoint import CheckpointError, latest_checkpoint, save_checkpoint
from swarm_node.train.worker import StageWorker

log = logging.getLogger(__name__)



class Checkpoints:
    def __init__(self, directory: Path | None, *, spec: RunSpec, compute: Compute,
                 command_line: tuple[str, ...] = (), identity_path: str | None = None):
        self.directory = directory
        self.spec = spec
        self.spec_hash = spec.spec_hash()
        self.compute = compute
        self.command_line = command_line
        self.identity_path = identity_path
        self.last_written: Path | None = None

    async def find(self, wanted_stage: int | None) -> tuple[dict, dict] | None:
        """The newest checkpoint of this run, checked to fit it: (tensors, meta)."""
        if self.directory is None:
            return None
        found = await self.compute(latest_checkpoint, self.directory)
        if found is None:
            log.info("no checkpoint in %s yet; starting fresh", self.directory)
            return None
        meta = found[1]
        if meta.get("spec_hash") != self.spec_hash:
            raise IncompatibleRun(
                f"the checkpoint in {self.directory} belongs to run spec "
                f"{meta.get('spec_hash')}, not to this run ({self.spec_hash}); give this run its "
                "own --checkpoint-dir"
            )
        stage = meta.get("stage")
        if type(stage) is not int or not 0 <= stage < self.spec.num_stages:
            raise CheckpointError(f"the checkpoint in {self.directory} names no valid stage ({stage!r})")
        if wanted_stage is not None and wanted_stage != stage:
            raise ConfigError(
                f"--stage {wanted_stage} conflicts with the checkpoint, which holds stage {stage}"
            )
        return found

    async def resume(self, worker: StageWorker, tensors: dict, meta: dict) -> dict | None:
        """Load a found checkpoint into ``worker``; returns the data position it saved."""
        try:
            await self.compute(worker.load_checkpoint_state, tensors, meta)
        except ValueError as exc:
            raise CheckpointError(f"the checkpoint in {self.directory} does not fit: {exc}") from None
        log.info("resumed from checkpoint %s: inner step %d, outer round %d", f"ckpt-{meta['step']:010d}",
                 worker.inner_step, worker.outer_round)
        return meta.get("data")

    async def save(self, worker: StageWorker, why: str, *, stage: int, peer_id: str,
                   data_position: Callable[[], dict | None] = lambda: None) -> None:
        """Write one; a full or read-only disk is logged and training goes on."""
        if self.directory is None:
            return

        def snapshot() -> tuple[dict, dict]:  # on the compute thread: consistent with the data position
            tensors, meta = worker.checkpoint_state()
            meta.update(spec_hash=self.spec_hash, run_id=self.spec.run_id, stage=stage, peer_id=peer_id,
                        version=__version__, data=data_position())
            return tensors, meta

        try:
            tensors, meta = await self.compute(snapshot)
            path = await asyncio.to_thread(save_checkpoint, self.directory, meta["inner_step"], tensors, meta)
            self.last_written = path
            # one after every round is routine; the shutdown one is what a volunteer looks for
            log.log(logging.INFO if why == "on shutdown" else logging.DEBUG, "checkpoint %s written (%s)",
                    path.name,
                    why)
        except OSError as exc:
            log.error("could not write a checkpoint to %s: %s", self.directory, exc)

    def how_to_resume(self, worker: StageWorker) -> str:
        """The last line a volunteer sees: where its progress is, and what to type to go on."""
        done = f"stopped at inner step {worker.inner_step} (outer round {worker.outer_round})"
        command = " ".join(shlex.quote(arg) for arg in self.command_line) or "swarm-node join ..."
        if self.last_written is None:
            return (f"{done}; nothing was saved. To resume next time, start with --checkpoint-dir DIR "
                    f"--identity FILE: {command} --checkpoint-dir DIR --identity FILE")
        keep_id = "" if self.identity_path else " (add --identity FILE to keep this peer id next time)"
        return f"{done}; checkpoint {self.last_written}. Resume with: {command}{keep_id}"

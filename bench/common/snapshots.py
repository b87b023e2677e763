"""Weights kept along a run, for loss-against-time curves evaluated afterwards (so the
curves cost the run no time): a hivemind peer writes its own snapshots; a swarm-node
node writes checkpoints, from which ``CheckpointCopier`` copies theta as they appear (a
node keeps only its last two). A snapshot is ``snap-r<replica>-<step>.pt`` holding the
step, the outer rounds a node had done (its ``sync``; none for a hivemind peer), the
wall time it was taken and the model's state dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointCopier:
    """``tick()`` copies theta out of every new checkpoint under ``checkpoint_dirs``
    (replica -> a node's --checkpoint-dir) into ``snapshot_dir``."""

    def __init__(self, checkpoint_dirs: dict[int, Path], snapshot_dir: Path, param_names: list[str]):
        self.checkpoint_dirs, self.snapshot_dir, self.param_names = checkpoint_dirs, snapshot_dir, param_names
        self.seen: set[Path] = set()

    def tick(self) -> None:
        for replica, directory in self.checkpoint_dirs.items():
            for ckpt in sorted(directory.glob("ckpt-*")):
                if ckpt not in self.seen and self._copy(replica, ckpt):
                    self.seen.add(ckpt)

    def _copy(self, replica: int, ckpt: Path) -> bool:
        try:
            meta = json.loads((ckpt / "meta.json").read_text())
            written = (ckpt / "meta.json").stat().st_mtime
            with safe_open(str(ckpt / "state.safetensors"), framework="pt") as f:
                state = {name: f.get_tensor(f"theta.{i}") for i, name in enumerate(self.param_names)}
        except (OSError, ValueError, json.JSONDecodeError):
            return False  # replaced while we read it; the next one will do
        path = self.snapshot_dir / f"snap-r{replica}-{meta['inner_step']:07d}.pt"
        torch.save({"step": meta["inner_step"], "sync": meta.get("outer_round"), "time": written,
                    "state": state},
                   path)
        return True


def load_snapshots(snapshot_dir: Path, launched: float) -> list[dict]:
    """Every snapshot in ``snapshot_dir`` as {replica, step, time_s (since ``launched``),
    state}, oldest first."""
    snaps = []
    for path in sorted(snapshot_dir.glob("snap-r*-*.pt")):
        data = torch.load(path, map_location="cpu")
        replica = int(path.stem.split("-")[1][1:])
        snaps.append({"replica": replica, "step": data["step"], "sync": data.get("sync"),
                      "time_s": data["time"] - launched, "state": data["state"]})
    return snaps

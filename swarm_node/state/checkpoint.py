"""Checkpoints on disk: tensors in safetensors, everything else in JSON, written
atomically and verified before loading.

Layout: ``<dir>/ckpt-<inner step>/{state.safetensors, meta.json}``. A checkpoint is
written into a hidden temporary directory, flushed to disk, and renamed into place, so
a crash leaves either the old checkpoint or the new one, never half of one. meta.json
records the size and SHA-256 of the tensor file; a checkpoint whose file does not
match (truncated, bit-flipped, partly copied) is reported and never loaded."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from swarm_node.errors import SwarmError
from swarm_node.system import fsync_dir, fsync_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
TENSORS_FILE = "state.safetensors"
META_FILE = "meta.json"
PREFIX = "ckpt-"


class CheckpointError(SwarmError):
    """A checkpoint on disk is unusable; the message names the file and the problem."""


def save_checkpoint(directory: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict,
                    keep: int = 2) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    staging = directory / f".tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        tensor_path = staging / TENSORS_FILE
        write_tensor_file(tensor_path, {k: v.detach().contiguous().cpu() for k, v in tensors.items()})
        fsync_file(tensor_path)
        full_meta = {**meta, "format": FORMAT_VERSION, "step": step,
                     "tensors_bytes": tensor_path.stat().st_size,
                     "tensors_sha256": _sha256(tensor_path)}
        (staging / META_FILE).write_text(json.dumps(full_meta, indent=1, sort_keys=True))
        fsync_file(staging / META_FILE)
        final = directory / f"{PREFIX}{step:010d}"
        if final.exists():  # the same step saved again (e.g. on SIGTERM right after a periodic save)
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_dir(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for old in sorted(directory.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_tensor_file(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """safetensors' save_file writes through a temporary file of mode 0600 and renames it
    into place; the file gets the mode its siblings get instead (the umask, or the mode it
    already had), so a checkpoint or export readable to others is readable as a whole."""
    path = Path(path)
    with open(path, "ab"):  # created the way write_text creates config.json and meta.json
        pass
    mode = stat.S_IMODE(path.stat().st_mode)
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, mode)


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """One checkpoint directory, verified; CheckpointError says what is wrong."""
    path = Path(path)
    try:
        meta = json.loads((path / META_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {META_FILE} is missing (an interrupted copy?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path / META_FILE} is not valid JSON ({exc}): the file is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else "?"
        raise CheckpointError(f"{path}: unknown checkpoint format {found}")
    tensor_path = path / TENSORS_FILE
    if not tensor_path.exists():
        raise CheckpointError(f"{tensor_path} is missing")
    size = tensor_path.stat().st_size
    if size != meta.get("tensors_bytes"):
        raise CheckpointError(
            f"{tensor_path} has {size} bytes but was written with {meta.get('tensors_bytes')}: "
            "it is truncated or was replaced"
        )
    if _sha256(tensor_path) != meta.get("tensors_sha256"):
        raise CheckpointError(f"{tensor_path} does not match the checksum it was written with: it is damaged")
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{tensor_path} does not load: {exc}") from None
    return tensors, meta


def latest_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict] | None:
    """The newest checkpoint that verifies; damaged newer ones are reported. None when
    the directory holds no checkpoint; CheckpointError when it holds only damaged ones."""
    candidates = sorted(Path(directory).glob(f"{PREFIX}*"), reverse=True) if Path(directory).is_dir() else []
    problems = []
    for path in candidates:
        try:
            loaded = load_checkpoint(path)
        except CheckpointError as exc:
            log.error("skipping damaged checkpoint: %s", exc)
            problems.append(str(exc))
            continue
        if problems:
            log.warning("resuming from the older checkpoint %s", path.name)
        return loaded
    if problems:
        raise CheckpointError(f"no usable checkpoint in {directory}: {problems[0]}; move the directory away "
                              "to start without it")
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


"""Where a node's training metrics go: JSON lines by default, TensorBoard and Weights &
Biases (offline) when asked for. Each sink gets ``log(step, metrics)`` after every outer
round and at the end; sinks that need an optional package say which one."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

SINKS = ("jsonl", "tensorboard", "wandb")


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line, flushed each time: `tail -f`-able, pandas-readable."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"time": round(time.time(), 3), "step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError("the TensorBoard sink needs the 'tensorboard' package: "
                              "pip install 'swarm-node[tensorboard]'") from None
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Offline mode: runs are written under the metrics directory and can be uploaded
    later with `wandb sync`; nothing leaves the machine during training."""

    def __init__(self, directory: Path, project: str, name: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise ImportError("the Weights & Biases sink needs the 'wandb' package: "
                              "pip install 'swarm-node[wandb]'") from None
        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(mode="offline", dir=str(directory), project=project, name=name, config=config,
                               reinit="create_new")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class Sinks:
    """All configured sinks as one; a sink that fails is logged and dropped, never
    allowed to stop training."""

    def __init__(self, sinks: list[MetricsSink]):
        self._sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in list(self._sinks):
            try:
                sink.log(step, metrics)
            except Exception as exc:  # a full disk or a sink bug must not stop training
                log.error("metrics sink %s failed (%s); dropping it", type(sink).__name__, exc)
                self._sinks.remove(sink)

    def close(self) -> None:
        for sink in self._sinks:
            try:
                sink.close()
            except Exception as exc:
                log.warning("closing metrics sink %s: %s", type(sink).__name__, exc)
        self._sinks = []


def open_sinks(kinds: tuple[str, ...], directory: Path, *, run_name: str, project: str,
               config: dict) -> Sinks:
    """``directory`` gets ``<run_name>.jsonl``, ``tensorboard/<run_name>/`` and ``wandb/``."""
    sinks: list[MetricsSink] = []
    for kind in kinds:
        if kind == "jsonl":
            sinks.append(JsonlSink(directory / f"metrics-{run_name}.jsonl"))
        elif kind == "tensorboard":
            sinks.append(TensorBoardSink(directory / "tensorboard" / run_name))
        elif kind == "wandb":
            sinks.append(WandbSink(directory / "wandb", project, run_name, config))
        else:
            raise ValueError(f"unknown metrics sink {kind!r}; choose from {', '.join(SINKS)}")
    return Sinks(sinks)

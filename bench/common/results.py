"""What every benchmark script shares: the result file format, machine facts, and plots.

A result file ``bench/results/<name>.json`` holds::

    {"benchmark": name, "mode": "quick" | "full", "command": "...", "started": ISO time,
     "wall_s": seconds, "machine": {...}, "rows": [ {...}, ... ], "summary": {...},
     "notes": ["...", ...]}

``rows`` are the table rows BENCHMARKS.md shows (flat dicts of numbers and strings);
``summary`` the few headline ratios. Plots go next to it as ``<name>*.png``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from bench.common import ROOT

RESULTS_DIR = ROOT / "bench" / "results"


def machine() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "torch_threads": torch.get_num_threads()}


def parse_mode(description: str, argv: list[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=_prog(), description=description)
    parser.add_argument("--full", action="store_true", help="the long version (default: quick)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    args.mode = "full" if args.full else "quick"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    return args


def run_mode(description: str, run: Callable[[str, Path], Result], plot: Callable[[list[dict], Path], None],
             argv: list[str] | None = None) -> None:
    """A benchmark whose run takes only its mode: parse ``--full``, run, plot, write."""
    args = parse_mode(description, argv)
    result = run(args.mode, args.out_dir)
    plot(result.rows, result.out_dir)
    result.write()


def _prog() -> str | None:
    """``python -m bench.<name>`` when a benchmark runs as its package's ``__main__``
    (argparse on Python 3.11 would call it ``__main__.py``); otherwise argparse's own."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.endswith(".__main__"):
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return None


class Result:
    """Collects rows and notes; ``write()`` stores the JSON with timing and machine facts."""

    def __init__(self, name: str, mode: str, out_dir: Path = RESULTS_DIR):
        self.name = name
        self.mode = mode
        self.out_dir = out_dir
        self.rows: list[dict] = []
        self.summary: dict = {}
        self.notes: list[str] = []
        self.wall_s: float | None = None  # set when the work ran before this process (a ledger's runs)
        self._started = time.time()
        self._started_iso = datetime.now(UTC).isoformat(timespec="seconds")

    def add(self, **row) -> dict:
        self.rows.append(row)
        return row

    def note(self, text: str) -> None:
        self.notes.append(text)

    def path(self, suffix: str = ".json") -> Path:
        return self.out_dir / f"{self.name}{suffix}"

    def _wall_s(self) -> float:
        return self.wall_s if self.wall_s is not None else time.time() - self._started

    def write(self) -> Path:
        payload = {"benchmark": self.name, "mode": self.mode,
                   "command": invocation(),
                   "started": self._started_iso, "wall_s": round(self._wall_s(), 1),
                   "machine": machine(), "rows": self.rows, "summary": self.summary, "notes": self.notes}
        path = self.path()
        path.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
        print(f"wrote {path}", file=sys.stderr)
        return path


def invocation() -> str:
    """This process's command line as typed: under ``python -m bench.x[.y]``, ``sys.argv[0]``
    holds the path of the module's file, which reads as another command (and one that
    cannot import ``bench``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        head = ["-m", spec.name.removesuffix(".__main__")]
    else:
        head = [sys.argv[0]] if sys.argv and sys.argv[0] else []
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *head, *sys.argv[1:]])


def rerun_command(name: str, mode: str) -> str:
    """The command that re-runs benchmark ``name`` in ``mode``, as BENCHMARKS.md shows it."""
    return f".venv/bin/python -m bench.{name}" + (" --full" if mode == "full" else "")


def load(name: str, out_dir: Path = RESULTS_DIR) -> dict | None:
    path = out_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def pyplot():
    """matplotlib's pyplot on the file-only backend (no display on these machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(ax, groups: list, series: list, value: Callable[[object, object], float]) -> None:
    """One group of bars per item of ``groups`` (ticks at 0, 1, ...), one bar in each per
    item of ``series``, labelled with it, ``value(group, series_item)`` high."""
    width = 0.8 / len(series)
    for k, name in enumerate(series):
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))],
               [value(group, name) for group in groups], width, label=name)
    ax.set_xticks(range(len(groups)))


def save_plot(fig, out_dir: Path, name: str) -> Path:
    """The figure as ``<out_dir>/<name>.png``, closed."""
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path

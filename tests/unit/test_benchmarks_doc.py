"""BENCHMARKS.md is what bench/report.py renders from the committed results: no number
in it is typed by hand, and every benchmark has results."""

import importlib.machinery
import json
import sys
import types
from pathlib import Path

from bench import report
from bench.common.results import RESULTS_DIR

KEYS = {"benchmark", "mode", "command", "started", "wall_s", "machine", "rows", "summary", "notes"}


def test_every_benchmark_has_results_with_rows_and_a_plot():
    for name in report.SECTIONS:
        if name in report.NEEDS_GPU and not (RESULTS_DIR / f"{name}.json").exists():
            continue  # measured on a GPU machine, when one is lent (bench/gpu_step/device_check.sh)
        result = json.loads((RESULTS_DIR / f"{name}.json").read_text())
        assert KEYS <= set(result) and result["benchmark"] == name and result["rows"], name
        assert list(RESULTS_DIR.glob(f"{name}*.png")), name


def test_benchmarks_md_is_the_rendering_of_the_results():
    assert report.DOC.read_text() == report.render(), "re-render it: make bench-report"


def test_every_image_the_document_shows_exists():
    text = report.DOC.read_text()
    for line in text.splitlines():
        if line.startswith("![") and "](" in line:
            path = line.split("](", 1)[1].rstrip(")")
            assert (Path(report.ROOT) / path).is_file(), path


def test_a_result_records_a_module_run_as_it_was_typed(monkeypatch):
    from bench.common.results import invocation

    main = types.ModuleType("__main__")  # what python -m leaves: the module's spec, its file in argv[0]
    monkeypatch.setitem(sys.modules, "__main__", main)
    main.__spec__ = importlib.machinery.ModuleSpec("bench.convergence.__main__", None)
    monkeypatch.setattr("sys.argv", [str(Path.cwd() / "bench" / "convergence" / "__main__.py"), "--full"])
    assert invocation().split(" ", 1)[1] == "-m bench.convergence --full"
    main.__spec__ = importlib.machinery.ModuleSpec("bench.scale.processes", None)
    monkeypatch.setattr("sys.argv", [str(Path.cwd() / "bench" / "scale" / "processes.py"), "--seeds", "3"])
    assert invocation().split(" ", 1)[1] == "-m bench.scale.processes --seeds 3"
    main.__spec__ = None  # a script run by its path
    monkeypatch.setattr("sys.argv", ["bench/run_all.py", "--only", "x"])
    assert invocation().endswith("bench/run_all.py --only x")

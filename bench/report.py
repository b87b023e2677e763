"""BENCHMARKS.md, rendered from bench/results/*.json: every number in it comes from
those files (each benchmark's ``bench/<name>/benchmark.py`` draws its own section with
``markdown(result)``)."""

from __future__ import annotations

import importlib
from pathlib import Path

from bench.common import ROOT
from bench.common.results import RESULTS_DIR, load

DOC = ROOT / "BENCHMARKS.md"
SECTIONS = ("transport", "sync_cost", "latency_model", "swarm_efficiency", "convergence", "size_trend",
            "vs_hivemind", "wire_bytes", "home_link", "gpu_volunteer",
            "scale", "state_check", "gpu_step")
# Benchmarks that need a CUDA card (bench/run_all.py leaves them out; their results come
# from a GPU machine: bench/gpu_step/device_check.sh).
NEEDS_GPU = ("gpu_step",)

HEADER = """# Benchmarks

Every table and plot below is rendered from `bench/results/*.json` by `bench/report.py`
(do not edit numbers by hand: re-run the benchmark, then `make bench-report`). Each
comparison is measured side by side in the same run on the same machine; absolute
times on shared 2-core machines are noisy, so read the ratios.

```bash
make bench          # quick versions of all of them, about 38 minutes on 2 cores
make bench-full     # the long versions
.venv/bin/python -m bench.<name> [--full]   # one of them
```

| benchmark | what it compares | mode | machine | wall |
|---|---|---|---|---|
{index}
"""

TITLES = {
    "transport": "one bulk transfer between two nodes: libp2p vs direct lanes vs raw TCP",
    "sync_cost": "NoLoCo pair exchange vs hivemind all-reduce, critical path",
    "latency_model": "the paper's latency model at N up to 1024, fed with measured times",
    "swarm_efficiency": "local swarm tokens/s vs plain single-process training",
    "convergence": "NoLoCo vs DiLoCo vs DDP vs local at equal tokens",
    "size_trend": "does NoLoCo keep up with DiLoCo as the model grows: the gap per model size, subword text",
    "vs_hivemind": "this project vs hivemind.Optimizer: time to a target loss, bytes",
    "wire_bytes": "bytes on the wire per round and per token",
    "home_link": "volunteers on shaped home links: blocking vs overlapped vs compressed rounds",
    "gpu_volunteer": "EMULATED GPU volunteers holding pipeline stages on 20 Mbit/s links: fp16 vs int8 vs "
                     "bottleneck8",
    "scale": "hundreds of peers a stage on the swarm-scale simulator, and 32 real processes",
    "state_check": "a downloaded state checked against the other replicas: honest vs hostile donors",
    "gpu_step": "a stage's step on one GPU: eager vs fused AdamW, chunked loss, torch.compile; MFU, memory",
}


def render(results_dir: Path = RESULTS_DIR) -> str:
    index, sections = [], []
    for name in SECTIONS:
        result = load(name, results_dir)
        if result is None:
            index.append(f"| [{name}](#{name}) | {TITLES[name]} | not run | | |")
            where = " on a CUDA machine (bench/gpu_step/device_check.sh)" if name in NEEDS_GPU else ""
            sections.append(f'<a id="{name}"></a>\n\n## {name}\n\nNo results yet: run '
                            f'`.venv/bin/python -m bench.{name}`{where}.\n')
            continue
        m = result["machine"]
        card = result["summary"].get("device_name") if name in NEEDS_GPU else None
        index.append(
            f"| [{name}](#{name}) | {TITLES[name]} | {result['mode']} | "
            f"{card or str(m['cpu_count']) + ' CPUs'}, torch {m['torch']} | {result['wall_s']:.0f} s |"
        )
        module = importlib.import_module(f"bench.{name}.benchmark")
        sections.append(f'<a id="{name}"></a>\n\n' + module.markdown(result).strip() + "\n")
    return HEADER.format(index="\n".join(index)) + "\n" + "\n".join(sections)


def write(results_dir: Path = RESULTS_DIR, path: Path = DOC) -> Path:
    path.write_text(render(results_dir))
    return path

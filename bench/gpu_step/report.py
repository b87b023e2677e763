"""bench.gpu_step's plot and its BENCHMARKS.md section, from the result's rows."""

from __future__ import annotations

from pathlib import Path

from bench.common.results import grouped_bars, pyplot, rerun_command, save_plot

NAME = "gpu_step"


def plot(rows: list[dict], out_dir: Path) -> Path | None:
    """Tokens/s of each stage by mode, one group of bars per (size, vocabulary, split, stage)."""
    if not rows:
        return None
    try:
        plt = pyplot()
    except ImportError:  # a GPU image without matplotlib: re-plot from the JSON elsewhere
        return None
    groups = list(dict.fromkeys((r["size"], r["vocab"], r["stages"], r["stage"]) for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by_key = {(r["size"], r["vocab"], r["stages"], r["stage"], r["mode"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(groups)), 4.0))
    grouped_bars(ax, groups, modes, lambda g, mode: by_key.get((*g, mode), {}).get("tokens_per_s", 0) / 1e3)
    ax.set_xticklabels([f"{size}\n{stages}st s{stage}" + ("" if vocab == 256 else f"\nV={vocab // 1000}k")
                        for size, vocab, stages, stage in groups], fontsize=8)
    ax.set_ylabel("thousand tokens/s (one stage, one card)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("a stage's step: tokens/s by mode")
    return save_plot(fig, out_dir, NAME)


def _gib(value: float | None) -> str:
    return "" if value is None else f"{value / 2**30:.2f}"


def _num(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f} %"


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [
        "## gpu_step: a stage's step on one card",
        "",
        f"`{rerun_command(NAME, result['mode'])}` on a CUDA machine ({result['mode']} mode, "
        f"{result['wall_s']:.0f} s, "
        f"{s.get('device_name', '?')}, torch {s.get('torch', '?')}, CUDA {s.get('cuda') or '-'})",
        "",
        f"One micro-batch of {s.get('batch_size')} x {s.get('seq_len')} tokens and its inner step, as a node "
        f"runs them (a non-last stage: forward, then the recomputed forward with the backward; the last: "
        f"forward with loss and backward; then clipping and AdamW), each stage on its own. `baseline`: "
        f"eager, foreach AdamW, the plain cross-entropy; `fused`: torch's fused AdamW and the chunked loss; "
        f"`compiled`: that with every decoder block through torch.compile (`--compile`). MFU counts model "
        f"FLOPs (6 x matmul parameters + 12 x layers x hidden x sequence per token; the recomputed forward "
        f"not counted) against the bf16 matrix product measured in the same run "
        f"({s.get('measured_peak_tflops', 0):.0f} TFLOP/s) and the spec sheet's dense bf16 peak "
        f"({s.get('spec_peak_tflops') or 'unknown'} TFLOP/s). Flash attention taken by the model's "
        f"attention: {s.get('flash_attention', 'not checked')}.",
        "",
        "| model | vocab | stages | stage | mode | tokens/s | MFU (measured peak) | MFU (spec) | peak memory "
        "GiB | estimate GiB | peak / estimate | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['size']} | {r['vocab']} | {r['stages']} | {r['stage']} | {r['mode']} | "
            f"{r['tokens_per_s']:,.0f} | {_pct(r['mfu_measured'])} | {_pct(r['mfu_spec'])} | "
            f"{_gib(r['peak_bytes'])} | {_gib(r['estimate_bytes'])} | {_num(r['peak_over_estimate'], 2)} | "
            f"{_num(r['compile_s'], 1)} |"
        )
    pipelines = s.get("pipeline_tokens_per_s", {})
    if pipelines:
        lines += ["", "The pipeline, one card a stage, runs at its slowest stage's rate (byte vocabulary):",
                  "",
                  "| model / stages | " + " | ".join(m for m in ("baseline", "fused",
                                                                 "compiled")) + " | speedup |",
                  "|---|---|---|---|---|"]
        for key, by_mode in pipelines.items():
            cells = [f"{by_mode[m]:,.0f}" if m in by_mode else "" for m in ("baseline", "fused", "compiled")]
            speedup = f"{by_mode['speedup']:.2f}x" if by_mode.get("speedup") else ""
            lines.append(f"| {key} | " + " | ".join(cells) + f" | {speedup} |")
    lines += ["", f"![tokens/s by mode](bench/results/{NAME}.png)"]
    if result["notes"]:
        lines += ["", "Notes:", "", *[f"- {n}" for n in result["notes"]]]
    return "\n".join(lines) + "\n"

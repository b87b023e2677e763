"""GPU step efficiency: a stage's step on one card, as a node runs it, eager and unfused
against the optimized path, per model size and stage split.

    python -m bench.gpu_step [--full]            on a CUDA machine (exit 2 without one)
    python -m bench.gpu_step --device cpu --quick  the CPU smoke run (debug model, seconds)

A step is what a node does for one micro-batch and its optimizer step: a non-last
stage runs the forward without autograd (``StageWorker.forward``), then the recompute
forward with autograd and the backward (``StageWorker.backward``); the last stage the
forward with the loss and its backward (``forward_backward_last``); then the inner
step (``StageWorker.step``, gradient clipping and AdamW). With 2 stages each stage is
timed on its own on the one card (a node holds one stage: the pipeline runs at the
slower stage's rate, one card a stage). Inputs and gradients are already on the card:
moving them is the transport's part (issue 34, items 1-3).

Modes, on the same weights, one after the other:
- ``baseline``: eager blocks, the foreach AdamW (bit-identical to torch's
  ``AdamW(foreach=True)``), the plain cross-entropy over the whole micro-batch's logits;
- ``fused``: eager blocks, torch's fused AdamW kernel, the chunked loss (model/loss.py);
- ``compiled``: ``fused`` with every decoder block through torch.compile (``--compile``,
  train/compiled.py; its compile and warm-up time is reported).

Figures: tokens/s of the stage; MFU = model FLOPs per token x tokens/s / peak, with
model FLOPs per token = 6 x the stage's matmul parameters (the LM head counted, the
embedding lookup not) + 12 x layers x hidden x sequence length (attention scores and
their use, forward and backward, PaLM's count, causal masking not discounted), and the
recomputed forward of non-last stages not counted (it is not model work). Peaks: the
card's bf16 matrix product measured in the same run (8192^3, the mean of 10 after 3
warm-ups) and the spec sheet's dense bf16 figure where the card is known. Peak memory:
torch's peak allocation over the mode's steps beside ``estimate_stage_memory`` (whose
resident state counts what an outer round keeps in flight, 16 bytes a parameter, which
no round allocates here). Whether the model's attention takes flash attention is
checked by running the stage with only that backend allowed.

Rows (``bench/results/gpu_step.json``): size, vocab, stages, stage, mode, batch_size,
seq_len, params, flops_per_token, step_s, tokens_per_s, mfu_measured, mfu_spec,
peak_bytes, estimate_bytes, peak_over_estimate, compile_s, loss. Summary: device facts,
``measured_peak_tflops``, ``spec_peak_tflops``, ``flash_attention``, and per
``"<size>/<stages>"`` (vocab 256) the pipeline tokens/s (the slowest stage's) by mode and
``speedup`` (compiled over baseline)."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass

import torch

from bench.common.results import Result, load, parse_mode
from bench.gpu_step.report import markdown, plot
from swarm_node.model.config import model_config
from swarm_node.model.links import stage_flops_per_token
from swarm_node.model.loss import LOSS_CHUNK_LOGITS
from swarm_node.model.memory import estimate_stage_memory
from swarm_node.optim.inner import fused_by_default
from swarm_node.spec import RunSpec
from swarm_node.train.compiled import compile_stage, uncompile_blocks
from swarm_node.train.device import autocast_dtype, device_facts

__all__ = ["main", "markdown"]

NAME = "gpu_step"
MODES = ("baseline", "fused", "compiled")
BYTE_VOCAB = 256  # the bundled corpus (what the measurements used)
PAPER_VOCAB = 32_000
# Dense bf16 tensor-core peaks from the vendors' spec sheets (TFLOP/s, no sparsity), by
# the first name fragment that the card's name holds.
SPEC_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
                    ("GH200", 989.4), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.1), ("L4", 121.0),
                    ("A10", 125.0), ("RTX 4090", 165.2), ("RTX 3090", 71.0))


@dataclass(frozen=True)
class Plan:
    device: str
    mode: str  # smoke (--quick), quick (default) or full
    cases: tuple[tuple[str, int, int], ...]  # (size, vocab, stages)
    batch_size: int
    seq_len: int
    warmup_steps: int
    steps: int
    modes: tuple[str, ...]


def plan_for(device: str, quick: bool, full: bool) -> Plan:
    if quick:  # the CPU smoke run: the tests run it in seconds; no compile (its import alone takes seconds)
        return Plan(device, "smoke", (("debug", BYTE_VOCAB, 1), ("debug", BYTE_VOCAB, 2)), 2, 32, 1, 2,
                    ("baseline", "fused"))
    # small first: the figures are for it; the result is written after every case,
    # so a run cut short by its time limit still reports what it measured
    cases = tuple((size, BYTE_VOCAB, stages) for size in ("small", "medium", "tiny") for stages in (1, 2))
    if full:
        cases += (("small", PAPER_VOCAB, 1), ("small", PAPER_VOCAB, 2))
    return Plan(device, "full" if full else "quick", cases, 8, 1024, 3, 20 if full else 10, MODES)


def spec_peak_tflops(name: str) -> float | None:
    return next((peak for fragment, peak in SPEC_BF16_TFLOPS if fragment in name), None)


def measured_peak_tflops(device: torch.device) -> float:
    """The card's bf16 matrix product (8192^3) in TFLOP/s; on the CPU an fp32 512^3 one."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    began = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    return 2 * n ** 3 * 10 / (time.perf_counter() - began) / 1e12


def flops_per_token(spec: RunSpec, stage: int, vocab: int) -> int:
    """Model FLOPs per token of one stage's training step (see the module docstring)."""
    config = model_config(spec.model_size, vocab_size=vocab, max_seq_len=spec.seq_len)
    return stage_flops_per_token(config, num_stages=spec.num_stages, stage_index=stage, seq_len=spec.seq_len)


def flash_attention_ok(worker) -> bool | None:
    """Whether the stage's attention runs with only flash attention allowed (None off CUDA)."""
    if worker.device.type != "cuda" or not len(worker.stage.model.layers):
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    inputs = _inputs(worker)[0]
    try:
        with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]), worker.autocast():
            worker.stage(inputs)
    except RuntimeError:
        return False
    return True


def _inputs(worker) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stage input, targets, gradient of the output) of one micro-batch, on the card."""
    spec, device = worker.spec, worker.device
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (spec.batch_size, spec.seq_len)
    hidden = worker.model_config.hidden_size
    targets = torch.randint(worker.model_config.vocab_size, shape, device=device, generator=generator)
    inputs = targets.roll(1, dims=1) if worker.is_first else torch.randn(*shape, hidden, device=device,
                                                                         generator=generator)
    grad = torch.randn(*shape, hidden, device=device, generator=generator) * 1e-3
    return inputs, targets, grad


def node_step(worker, inputs: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor) -> float | None:
    """One micro-batch and the inner step, as a node runs them; the loss on the last stage."""
    loss = None
    if worker.is_last:
        loss, _ = worker.forward_backward_last(None if worker.is_first else inputs, targets,
                                               inputs if worker.is_first else None)
    else:
        worker.forward(inputs)
        worker.backward(inputs, grad)
    if not worker.is_first:
        inputs.grad = None  # the same input tensor each step: no gradient piles up on it
    worker.step()
    return loss


def set_mode(worker, mode: str) -> float | None:
    """Switch the worker to ``mode``; returns the compile time when compiling."""
    worker.inner.fused = mode != "baseline" and (
        fused_by_default(worker.device) or worker.device.type == "cpu"
    )
    worker.stage.loss_chunk_logits = None if mode == "baseline" else LOSS_CHUNK_LOGITS
    uncompile_blocks(worker.stage)
    return compile_stage(worker) if mode == "compiled" else None


def measure(worker, plan: Plan, mode: str) -> dict:
    device = worker.device
    compile_s = set_mode(worker, mode)
    inputs, targets, grad = _inputs(worker)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(plan.warmup_steps):
        node_step(worker, inputs, targets, grad)
    _sync(device)
    began = time.perf_counter()
    loss = None
    for _ in range(plan.steps):
        loss = node_step(worker, inputs, targets, grad)
    _sync(device)
    step_s = (time.perf_counter() - began) / plan.steps
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"mode": mode, "step_s": step_s, "tokens_per_s": plan.batch_size * plan.seq_len / step_s,
            "peak_bytes": peak, "compile_s": compile_s, "loss": loss}


def run_case(plan: Plan, size: str, vocab: int, stages: int, peaks: dict, result: Result) -> None:
    from swarm_node.train.worker import StageWorker

    spec = RunSpec(model_size=size, num_stages=stages, batch_size=plan.batch_size, seq_len=plan.seq_len,
                   samples_per_step=plan.batch_size)
    config = model_config(size, vocab_size=vocab, max_seq_len=plan.seq_len)
    facts = device_facts(plan.device)
    for stage in range(stages):
        estimates = {chunk: estimate_stage_memory(config, num_stages=stages, stage_index=stage,
                                                  batch_size=plan.batch_size, seq_len=plan.seq_len,
                                                  autocast_bf16=autocast_dtype(facts) is torch.bfloat16,
                                                  loss_chunk_logits=chunk).peak_bytes
                     for chunk in (None, LOSS_CHUNK_LOGITS)}
        if facts.total_memory_bytes and min(estimates.values()) > 0.97 * facts.total_memory_bytes:
            result.note(f"{size}, {stages} stage(s), stage {stage}: skipped, its estimate "
                        f"({min(estimates.values()) / 2**30:.1f} GiB) does not fit the card")
            continue
        worker = StageWorker(spec, stage, vocab, device=plan.device)
        if "flash_attention" not in result.summary and (flash := flash_attention_ok(worker)) is not None:
            result.summary["flash_attention"] = flash
        flops = flops_per_token(spec, stage, vocab)
        for mode in plan.modes:
            try:
                row = measure(worker, plan, mode)
            except torch.OutOfMemoryError:
                result.note(f"{size}, {stages} stage(s), stage {stage}, {mode}: out of memory")
                torch.cuda.empty_cache()
                continue
            estimate = estimates[None if mode == "baseline" else LOSS_CHUNK_LOGITS]
            row = {
                "size": size,
                "vocab": vocab,
                "stages": stages,
                "stage": stage,
                **row,
                "batch_size": plan.batch_size,
                "seq_len": plan.seq_len,
                "params": sum(p.numel() for p in worker.params),
                "flops_per_token": flops,
                "mfu_measured": flops * row["tokens_per_s"] / (peaks["measured"] * 1e12),
                "mfu_spec": flops * row["tokens_per_s"] / (peaks["spec"] * 1e12) if peaks["spec"] else None,
                "estimate_bytes": estimate,
                "peak_over_estimate": row["peak_bytes"] / estimate if row["peak_bytes"] else None,
            }
            result.add(**row)
            print(_line(row), flush=True)
        del worker
        gc.collect()
        if plan.device.startswith("cuda"):
            torch.cuda.empty_cache()


def summarize(result: Result) -> None:
    """Per size and split (byte vocabulary): the pipeline's tokens/s (its slowest stage) by mode."""
    pipelines = {}
    for row in result.rows:
        if row["vocab"] != BYTE_VOCAB:
            continue
        key = f"{row['size']}/{row['stages']}"
        by_mode = pipelines.setdefault(key, {})
        by_mode[row["mode"]] = min(by_mode.get(row["mode"], float("inf")), row["tokens_per_s"])
    for by_mode in pipelines.values():
        if "baseline" in by_mode:
            best = max(v for m, v in by_mode.items() if m != "baseline") if len(by_mode) > 1 else None
            by_mode["speedup"] = best / by_mode["baseline"] if best else None
    result.summary["pipeline_tokens_per_s"] = pipelines


def _line(row: dict) -> str:
    peak = f"{row['peak_bytes'] / 2**30:6.2f} GiB peak / {row['estimate_bytes'] / 2**30:6.2f} estimate" \
        if row["peak_bytes"] else f"estimate {row['estimate_bytes'] / 2**30:.2f} GiB"
    mfu = f"MFU {100 * row['mfu_measured']:5.1f} % of measured" + \
        (f", {100 * row['mfu_spec']:5.1f} % of spec" if row["mfu_spec"] else "")
    compiled = f", compiled in {row['compile_s']:.1f} s" if row["compile_s"] is not None else ""
    return (f"{row['size']:>6} V={row['vocab']:<6} {row['stages']} stage(s), stage {row['stage']}: "
            f"{row['mode']:<8} {row['tokens_per_s']:>12,.0f} tok/s  {mfu}  {peak}{compiled}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", help="cuda[:N] (default) or cpu (with --quick)")
    parser.add_argument("--quick", action="store_true", help="the CPU smoke run: debug model, a few steps")
    parser.add_argument(
        "--replot",
        action="store_true",
        help="only draw the plot again from OUT_DIR/gpu_step.json (a result from a GPU machine)",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_mode(__doc__.split("\n\n")[0], argv, _extra)
    if args.replot:
        print(plot(load(NAME, args.out_dir)["rows"], args.out_dir))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"bench.gpu_step: no CUDA device here (torch {torch.__version__}); run it on a GPU machine, or "
              "--device cpu --quick for the CPU smoke run", file=sys.stderr)
        return 2
    if device.type == "cpu" and not args.quick:
        print("bench.gpu_step: on the CPU only the smoke run (--quick) is meaningful", file=sys.stderr)
        return 2
    plan = plan_for(str(device), args.quick, args.full)
    result = Result(NAME, plan.mode, args.out_dir)
    facts = device_facts(device)
    peaks = {"measured": measured_peak_tflops(device), "spec": spec_peak_tflops(facts.name)}
    result.summary.update(device=facts.device, device_name=facts.name, capability=facts.capability,
                          memory_bytes=facts.total_memory_bytes, torch=torch.__version__,
                          cuda=torch.version.cuda, measured_peak_tflops=peaks["measured"],
                          spec_peak_tflops=peaks["spec"], batch_size=plan.batch_size, seq_len=plan.seq_len,
                          steps=plan.steps)
    print(f"{facts.describe()}: matrix product peak {peaks['measured']:.3g} TFLOP/s measured, "
          f"{peaks['spec'] or 'unknown'} on the spec sheet", flush=True)
    for size, vocab, stages in plan.cases:
        run_case(plan, size, vocab, stages, peaks, result)
        summarize(result)
        result.write()
    plot(result.rows, result.out_dir)
    return 0

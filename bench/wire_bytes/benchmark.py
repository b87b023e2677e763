"""Benchmark 6: bytes on the wire per outer round and per token, for each method.

A cost model computed from the models' parameter counts and the wire precisions of
``swarm_node/wire/frames.py``, for the project's sizes and the paper's Small/Medium/Large,
then checked against what the transport of a real ``swarm-node local`` run counts.

    .venv/bin/python -m bench.wire_bytes [--full]

Methods (bytes *sent* by one worker; it receives as much):
- NoLoCo here: phi and Delta in fp16 to one partner per round (the partner answers
  with its own);
- NoLoCo reference: the same exchange in fp32 (github jkolehm/noloco);
- DiLoCo all-reduce: a butterfly all-reduce of Delta in fp32 sends 2 (N-1)/N of it;
- DiLoCo here (``--method diloco``): every member swaps phi and Delta in fp16 with
  every other member of the stage (an all-gather, (N-1) payloads);
- DDP: a butterfly all-reduce of the fp32 gradients at every inner step;
- pipeline: activations (fp16) and target ids (int32) forward, activation gradients
  (fp16) backward, per token and stage boundary.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common.procs import ChildFailed, run_to_end
from bench.common.results import Result, parse_mode, pyplot, rerun_command
from bench.common.sandbox import Sandbox
from swarm_node.model.config import NAMED_SIZES, model_config
from swarm_node.model.stages import build_stage
from swarm_node.wire.frames import WIRE_PRECISIONS, encode_frame

NAME = "wire_bytes"
BYTE_VOCAB = 256  # the bundled corpus, byte-level tokenizer
PAPER_VOCAB = 32_000  # assumed: a Llama tokenizer for the paper's Llama-style models
PAPER_SEQ_LEN = 1024
TARGET_BYTES = 4  # target ids travel as int32 with the activations
LENGTH_PREFIX_BYTES = 8  # the transport's frame length (swarm_node/net/transport.py)
CHECK_TOLERANCE = 0.01  # measured bytes within 1 % of the model (what is left: pairing proposals and answers)


@dataclass(frozen=True)
class Setting:
    """How often each method talks, which sets its per-token share."""
    peers: int = 8  # N, data-parallel workers of a stage (the paper's most common DP)
    noloco_inner_steps: int = 50  # H, NoLoCo's default (reference code)
    diloco_inner_steps: int = 100  # H, DiLoCo's default (reference code)
    tokens_per_step: int = 8 * 64  # sequences x sequence length per worker and inner step


@dataclass(frozen=True)
class ModelSize:
    name: str
    source: str  # "project" (swarm_node/model/config.py, byte vocabulary) or "paper"
    params: int
    hidden: int
    tokens_per_step: int


def model_sizes() -> list[ModelSize]:
    """The project's named sizes on the bundled corpus, and the paper's three models
    (the same shapes with a 32k vocabulary and 1024-token sequences)."""
    sizes = []
    for name in NAMED_SIZES:
        config = model_config(name, vocab_size=BYTE_VOCAB, max_seq_len=64)
        sizes.append(ModelSize(name, "project", config.num_parameters(), config.hidden_size,
                               Setting.tokens_per_step))
    for name in ("small", "medium", "large"):
        config = model_config(name, vocab_size=PAPER_VOCAB, max_seq_len=PAPER_SEQ_LEN)
        sizes.append(ModelSize(f"paper {name.capitalize()}", "paper", config.num_parameters(),
                               config.hidden_size,
                               8 * PAPER_SEQ_LEN))
    return sizes


def itemsize(precision: str) -> int:
    return WIRE_PRECISIONS[precision].itemsize


def butterfly_share(peers: int) -> float:
    """Fraction of the payload one peer sends in a butterfly all-reduce: it scatters
    (N-1)/N of its tensor and gathers back as much of the reduced result."""
    return 2 * (peers - 1) / peers


def pair_exchange_bytes(params: int, precision: str) -> int:
    """phi and Delta of every parameter, once, to the partner."""
    return 2 * params * itemsize(precision)


def pipeline_bytes_per_token(hidden: int, precision: str = "fp16") -> int:
    """One stage boundary, both directions: activations + target id forward, the
    activation gradient backward."""
    return 2 * hidden * itemsize(precision) + TARGET_BYTES


def method_rows(size: ModelSize, setting: Setting) -> list[dict]:
    """Bytes one worker holding the whole model sends per synchronisation, and per token
    it trains on. A synchronisation is an outer round for NoLoCo and DiLoCo (every H
    inner steps), an inner step for DDP and the pipeline. A worker holding one of S
    stages sends 1/S of the outer figures; pipeline rows are per stage boundary."""
    n, p = setting.peers, size.params
    noloco_h, diloco_h = setting.noloco_inner_steps, setting.diloco_inner_steps
    per_sync = [
        ("noloco", "fp16", "phi + Delta to 1 partner", noloco_h, pair_exchange_bytes(p, "fp16")),
        ("noloco-reference", "fp32", "phi + Delta to 1 partner", noloco_h, pair_exchange_bytes(p, "fp32")),
        ("diloco-allreduce", "fp32", f"butterfly all-reduce of Delta, N={n}", diloco_h,
         butterfly_share(n) * p * 4),
        ("diloco-here", "fp16", f"phi + Delta to each of the N-1={n - 1} others", diloco_h,
         (n - 1) * pair_exchange_bytes(p, "fp16")),
        ("ddp", "fp32", f"all-reduce of gradients, N={n}", 1, butterfly_share(n) * p * 4),
        ("pipeline", "fp16", "activations + targets fwd, gradients bwd, 1 boundary", 1,
         size.tokens_per_step * pipeline_bytes_per_token(size.hidden)),
    ]
    reference_per_token = pair_exchange_bytes(p, "fp32") / (noloco_h * size.tokens_per_step)
    rows = []
    for method, wire, what, every, sent in per_sync:
        per_token = sent / (every * size.tokens_per_step)
        rows.append({"model": size.name, "source": size.source, "params": p, "method": method, "wire": wire,
                     "what": what, "peers": n, "every_steps": every, "tokens_per_step": size.tokens_per_step,
                     "bytes_per_sync": int(round(sent)), "bytes_per_token": per_token,
                     "per_token_vs_reference": per_token / reference_per_token})
    return rows


# -- the check against a real run ------------------------------------------------------
@dataclass(frozen=True)
class CheckRun:
    stages: int = 2
    replicas: int = 2
    steps: int = 60
    inner_steps: int = 10
    batch_size: int = 8
    seq_len: int = 64
    model: str = "debug"


def frame_sizes(run: CheckRun) -> dict:
    """Exact frame sizes of this run's messages, built with the node's own codec and
    header fields (values of the same encoded length), plus the transport's prefix."""
    config = model_config(run.model, vocab_size=BYTE_VOCAB, max_seq_len=run.seq_len)
    spec_hash = "0" * 16
    hidden = torch.zeros(run.batch_size, run.seq_len, config.hidden_size, dtype=torch.float16)
    targets = torch.zeros(run.batch_size, run.seq_len, dtype=torch.int32)
    sizes = {"forward": len(encode_frame({"kind": "fwd", "spec": spec_hash, "deadline_s": 30.0},
                                         [hidden, targets])),
             "gradient": len(encode_frame({"ok": True, "loss": 1.0}, [hidden]))}
    for stage in range(run.stages):
        module = build_stage(config, num_stages=run.stages, stage_index=stage, seed=0)
        wire = [p.detach().to(torch.float16) for p in module.parameters()]
        header = {"kind": "outer", "spec": spec_hash, "round": 1, "ok": True}
        sizes[f"outer{stage}"] = len(encode_frame(header, wire + wire))
    return {k: v + LENGTH_PREFIX_BYTES for k, v in sizes.items()}


def predicted_sent(peer: dict, sizes: dict, num_stages: int) -> int:
    """What a peer should have sent: its micro-batch frames (stage 0 sends activations,
    with retries; the last stage answers with gradients) plus one outer frame per round
    with a partner."""
    stage = peer["stage"]
    sent = peer["rounds_with_partner"] * sizes[f"outer{stage}"]
    if stage < num_stages - 1:
        sent += (peer["microbatches_done"] + peer["retries"]) * sizes["forward"]
    if stage > 0:
        sent += peer["microbatches_done"] * sizes["gradient"]
    return sent


def run_check(run: CheckRun, timeout_s: float) -> dict:
    """A tiny ``swarm-node local`` run (in a sandbox of its own where we can, which also
    counts every byte on its loopback); returns its JSON summary and the command."""
    args = ["local", "--stages", str(run.stages), "--replicas", str(run.replicas), "--model", run.model,
            "--steps", str(run.steps), "--inner-steps", str(run.inner_steps), "--batch-size",
            str(run.batch_size), "--seq-len", str(run.seq_len),
            "--outer-codec", "fp16"]  # the frames this model predicts (the default codec: bench/home_link)
    work = Path(tempfile.mkdtemp(prefix="sbe-wire-"))
    try:
        with ExitStack() as stack:
            box = stack.enter_context(Sandbox("wire")) if Sandbox.available() else None
            before = box.tx_bytes() if box else None
            cmd = [sys.executable, "-m", "swarm_node", *args, "--json-out", str(work / "summary.json"),
                   "--no-progress"]
            run_to_end(box.command(cmd) if box else cmd, timeout_s, log_path=work / "local.log")
            loopback = box.tx_bytes() - before if box else None
        return {"command": " ".join(["swarm-node", *args]), "loopback_bytes": loopback,
                **json.loads((work / "summary.json").read_text())}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def refused_requests(peer: dict, sizes: dict, num_stages: int) -> int:
    """Outer payloads the partner declined after they arrived (its screens before its
    first round, or a lapsed reservation): each shows as a full extra outer frame. What
    is left over is the pairing proposals and answers, tens of bytes each."""
    extra = peer["bytes_sent"] - predicted_sent(peer, sizes, num_stages)
    return max(0, round(extra / sizes[f"outer{peer['stage']}"]))


def check_rows(run: CheckRun, summary: dict) -> list[dict]:
    sizes = frame_sizes(run)
    rows = []
    for peer in summary["peers"]:
        exchanges = predicted_sent(peer, sizes, run.stages)
        refused = refused_requests(peer, sizes, run.stages)
        modelled = exchanges + refused * sizes[f"outer{peer['stage']}"]
        rows.append({"check": "peer", "stage": peer["stage"], "peer": (peer["peer_id"] or "?")[-6:],
                     "microbatches": peer["microbatches_done"], "retries": peer["retries"],
                     "rounds_with_partner": peer["rounds_with_partner"], "refused_requests": refused,
                     "bytes_sent": peer["bytes_sent"], "predicted_exchanges": exchanges,
                     "predicted": modelled, "residual": peer["bytes_sent"] - modelled,
                     "ratio": peer["bytes_sent"] / modelled if modelled else None})
    return rows


def outer_check(run: CheckRun, peer_rows: list[dict]) -> list[dict]:
    """Per stage: outer bytes actually sent (a peer's total minus its micro-batch frames,
    which the model predicts exactly) per round with a partner, against our fp16 frame
    and the reference's fp32 exchange of the same tensors."""
    sizes = frame_sizes(run)
    config = model_config(run.model, vocab_size=BYTE_VOCAB, max_seq_len=run.seq_len)
    rows = []
    for stage in range(run.stages):
        peers = [r for r in peer_rows if r["stage"] == stage]
        rounds = sum(r["rounds_with_partner"] for r in peers)
        if not rounds:
            continue
        microbatch_bytes = sum(r["predicted_exchanges"] - r["rounds_with_partner"] * sizes[f"outer{stage}"]
                               for r in peers)
        outer = sum(r["bytes_sent"] for r in peers) - microbatch_bytes
        params = sum(p.numel() for p in build_stage(config, num_stages=run.stages, stage_index=stage,
                                                     seed=0).parameters())
        reference = pair_exchange_bytes(params, "fp32")
        rows.append({"check": "outer", "stage": stage, "stage_params": params, "rounds": rounds,
                     "refused_requests": sum(r["refused_requests"] for r in peers), "measured_bytes": outer,
                     "measured_per_round": int(outer / rounds), "predicted_fp16": sizes[f"outer{stage}"],
                     "reference_fp32": reference, "vs_reference": outer / rounds / reference,
                     "ideal_vs_reference": sizes[f"outer{stage}"] / reference})
    return rows


def build_result(result: Result, setting: Setting, run: CheckRun, summary: dict | None) -> None:
    table = [row for size in model_sizes() for row in method_rows(size, setting)]
    result.rows = table
    paper_small = {r["method"]: r for r in table if r["model"] == "paper Small"}
    result.summary = {"peers": setting.peers, "noloco_inner_steps": setting.noloco_inner_steps,
                      "diloco_inner_steps": setting.diloco_inner_steps,
                      "noloco_vs_reference": paper_small["noloco"]["per_token_vs_reference"],
                      "paper_small_per_token": {m: r["bytes_per_token"] for m, r in paper_small.items()},
                      "tolerance": CHECK_TOLERANCE}
    if summary is None:
        return
    peers = check_rows(run, summary)
    outer = outer_check(run, peers)
    result.rows = table + peers + outer
    payload = sum(p["bytes_sent"] for p in summary["peers"])
    deviation = max(abs(r["residual"]) / r["bytes_sent"] for r in peers if r["bytes_sent"])
    result.summary.update(
        {
            "check_command": summary["command"],
            "check_max_deviation": deviation,
            "check_within_tolerance": deviation <= CHECK_TOLERANCE,
            "refused_requests": sum(r["refused_requests"] for r in peers),
            "rounds_with_partner": sum(r["rounds_with_partner"] for r in peers),
            "measured_outer_vs_reference": sum(r["measured_bytes"] for r in outer)
            / sum(r["rounds"] * r["reference_fp32"] for r in outer)
            if outer
            else None,
            "ideal_outer_vs_reference": max(r["ideal_vs_reference"] for r in outer) if outer else None,
            "check_payload_bytes": payload,
            "check_loopback_bytes": summary["loopback_bytes"],
            "check_loopback_vs_payload": summary["loopback_bytes"] / payload
            if summary["loopback_bytes"]
            else None,
        }
    )


def plot(result: Result) -> None:
    plt = pyplot()
    table = [r for r in result.rows if "bytes_per_sync" in r and r["source"] == "paper"]
    models = list(dict.fromkeys(r["model"] for r in table))
    methods = list(dict.fromkeys(r["method"] for r in table))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [next(r["bytes_per_token"] for r in table if r["model"] == m and r["method"] == method)
                  for m in models]
        ax.bar([x + i * width for x in range(len(models))], values, width, label=method)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(models))], models)
    ax.set_yscale("log")
    ax.set_ylabel("bytes sent per token trained, per worker")
    ax.set_title(f"the paper's models, N = {result.summary['peers']} workers per stage, NoLoCo H = "
                 f"{result.summary['noloco_inner_steps']}, DiLoCo H = {result.summary['diloco_inner_steps']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(result.path(".png"), dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_mode(__doc__.split("\n\n")[0], argv)
    result = Result(NAME, args.mode, args.out_dir)
    run = CheckRun(replicas=4, steps=200, inner_steps=20) if args.mode == "full" else CheckRun()
    try:
        summary = run_check(run, timeout_s=300.0 if args.mode == "full" else 120.0)
    except ChildFailed as exc:  # the cost model stands without it; say why the check is missing
        summary = None
        result.note(f"the check run failed: {exc}")
    build_result(result, Setting(), run, summary)
    plot(result)
    result.write()
    return 0


METHOD_TITLES = {"noloco": "NoLoCo here (fp16)", "noloco-reference": "NoLoCo reference (fp32)",
                 "diloco-allreduce": "DiLoCo all-reduce (fp32)", "diloco-here": "DiLoCo here (fp16)",
                 "ddp": "DDP (fp32)", "pipeline": "pipeline, 1 boundary (fp16)"}


def human_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


def human_count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _pivot(table: list[dict], key: str, fmt) -> list[str]:
    methods = list(dict.fromkeys(r["method"] for r in table))
    lines = ["| model | parameters | " + " | ".join(METHOD_TITLES.get(m, m) for m in methods) + " |",
             "|---|---:|" + "---:|" * len(methods)]
    for model in dict.fromkeys(r["model"] for r in table):
        cells = {r["method"]: r for r in table if r["model"] == model}
        params = next(iter(cells.values()))["params"]
        lines.append(
            f"| {model} | {human_count(params)} | " + " | ".join(fmt(cells[m][key]) for m in methods) + " |"
        )
    return lines


def _check_section(result: dict) -> list[str]:
    s = result["summary"]
    peers = [r for r in result["rows"] if r.get("check") == "peer"]
    outer = [r for r in result["rows"] if r.get("check") == "outer"]
    if not peers:
        return ["No check run is in this result (see the notes)."]
    lines = [
        f"`{s['check_command']}` on loopback. The transport counts every frame it writes (`bytes_sent` of "
        "the JSON summary). The model: the micro-batch frames and one outer frame per round with a partner, "
        "built with the node's own codec, plus one outer frame per payload a partner declined after it "
        "arrived (inferred from the excess, a whole number of frames). The residual is the pairing "
        "proposals and their answers, tens of bytes each.",
        "",
        "| stage | peer | micro-batches | retries | rounds with a partner | declined payloads | bytes sent "
        "| model | residual (B) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in peers:
        lines.append(f"| {r['stage']} | `{r['peer']}` | {r['microbatches']} | {r['retries']} | "
                     f"{r['rounds_with_partner']} | {r['refused_requests']} | {r['bytes_sent']:,} | "
                     f"{r['predicted']:,} | {r['residual']:,} |")
    lines += ["", "| stage | parameters | rounds with a partner | declined payloads | measured per round | "
              "our fp16 frame | reference fp32 | measured / reference | frame / reference |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in outer:
        lines.append(f"| {r['stage']} | {r['stage_params']:,} | {r['rounds']} | {r['refused_requests']} | "
                     f"{r['measured_per_round']:,} | {r['predicted_fp16']:,} | {r['reference_fp32']:,} | "
                     f"{r['vs_reference']:.3f} | {r['ideal_vs_reference']:.3f} |")
    verdict = "within" if s["check_within_tolerance"] else "NOT within"
    lines += [
        "",
        f"Every peer's measured bytes are {verdict} {s['tolerance']:.0%} of the model (largest residual "
        f"{s['check_max_deviation']:.3%} of a peer's bytes: the pairing proposals and answers). "
        f"One exchange costs {s['ideal_outer_vs_reference']:.2f} of the reference's fp32 exchange; "
        f"measured over {s['rounds_with_partner']} peer-rounds with a partner ({s['refused_requests']} "
        f"declined payloads) it came to {s['measured_outer_vs_reference']:.2f} of it per round.",
    ]
    if s.get("check_loopback_vs_payload"):
        lines += [
            "",
            "Everything on the run's loopback (its own network namespace: DHT, libp2p, TCP/IP headers, "
            f"the bootstrap) came to {human_bytes(s['check_loopback_bytes'])}, "
            f"{s['check_loopback_vs_payload']:.2f}x the {human_bytes(s['check_payload_bytes'])} of payload "
            "the transports counted.",
        ]
    return lines


def _meaning(s: dict, table: list[dict]) -> str:
    small = s["paper_small_per_token"]
    per_token = {(r["model"], r["method"]): r["bytes_per_token"] for r in table if r["source"] == "paper"}
    models = list(dict.fromkeys(m for m, _ in per_token))
    heavier = [m for m in models if per_token[m, "pipeline"] > per_token[m, "noloco"]]
    lighter = [m for m in models if m not in heavier]
    how_often = s["diloco_inner_steps"] / s["noloco_inner_steps"]
    pipeline = (
        f"The pipeline's activations cost more per token and boundary than NoLoCo's rounds for "
        f"{', '.join(heavier) or 'none of the paper models'} and less for {', '.join(lighter) or 'none'}: "
        "they grow with the hidden size only, the rounds with the parameter count."
    )
    return (
        f"NoLoCo here sends {s['noloco_vs_reference']:.2f}x what the reference sends per round: fp16 "
        "instead of fp32 for the same phi and Delta. For the paper's Small model it sends "
        f"{small['noloco']:,.0f} bytes per token against {small['diloco-allreduce']:,.0f} for DiLoCo's fp32 "
        f"all-reduce ({small['noloco'] / small['diloco-allreduce']:.2f}x, DiLoCo syncing {how_often:g}x less "
        f"often) and {small['ddp']:,.0f} for DDP ({small['ddp'] / small['noloco']:,.0f}x NoLoCo). "
        f"{pipeline} Pairing does not make a round smaller than an all-reduce's share; what it buys is a "
        "cost that does not grow with N and no global barrier (see sync_cost and latency_model)."
        + _declined(s)
    )


def _declined(s: dict) -> str:
    if not s.get("refused_requests"):
        return ""
    return (
        f" Short of the model: {s['refused_requests']} payloads were declined after they arrived in the real "
        f"run (a partner before its first round found them out of scale, or a reservation had lapsed); each "
        f"cost a full payload and together they took a round from {s['ideal_outer_vs_reference']:.2f} to "
        f"{s['measured_outer_vs_reference']:.2f} of the reference's bytes."
    )


def markdown(result: dict) -> str:
    s = result["summary"]
    table = [r for r in result["rows"] if "bytes_per_sync" in r]
    lines = [
        "## wire_bytes: bytes on the wire per round and per token",
        "",
        f"`{rerun_command(NAME, result['mode'])}` ({result['mode']} mode, {result['wall_s']:.0f} s)",
        "",
        f"What one worker sends (it receives as much), computed from the parameter counts of "
        f"`swarm_node/model/config.py` and the wire precisions of `swarm_node/wire/frames.py`. Project sizes "
        f"use the bundled corpus's byte vocabulary and 8 x 64 tokens per step; the paper's "
        f"Small/Medium/Large use an assumed 32k vocabulary and 8 x 1024 tokens per step (per-token figures "
        f"of the outer methods scale inversely with that). N = {s['peers']} workers per stage; NoLoCo syncs "
        f"every H = {s['noloco_inner_steps']} inner steps, DiLoCo every {s['diloco_inner_steps']} (the "
        f"reference code's defaults), DDP every step. A worker holding one of S stages sends 1/S of the "
        f"outer figures. \"DiLoCo here\" is `--method diloco` of this project, which swaps phi and Delta "
        f"with every other member (an all-gather) instead of all-reducing Delta.",
        "",
        "### Bytes per token trained, per worker",
        "",
        *_pivot(table, "bytes_per_token", lambda v: f"{v:,.1f}"),
        "",
        "### Bytes per synchronisation (outer round; DDP and pipeline: inner step), per worker",
        "",
        *_pivot(table, "bytes_per_sync", human_bytes),
        "",
        "![bytes per token](bench/results/wire_bytes.png)",
        "",
        "### Checked against a real run",
        "",
        *_check_section(result),
        "",
        "### What it means",
        "",
        _meaning(s, table),
    ]
    if result["notes"]:
        lines += ["", "Notes:", "", *[f"- {n}" for n in result["notes"]]]
    return "\n".join(lines) + "\n"

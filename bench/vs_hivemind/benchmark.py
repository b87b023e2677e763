"""Benchmark 5: this project against hivemind.Optimizer, the same model, peers and tokens.

    .venv/bin/python -m bench.vs_hivemind [--full]

(a) hivemind.Optimizer: N peer processes, each with its own DHT, training the project's
Llama-style model (one full stage) on its shard of the bundled corpus with the same
inner AdamW, clipping and lr schedule; ``use_local_updates=True`` (local AdamW steps,
parameters averaged by all-reduce once per epoch of H local steps per peer, the mode
that matches a low-communication trainer), and in full mode also the default mode
(gradients all-reduced over the same global batch, one optimizer step per epoch).
(b) this project: ``swarm-node local --stages 1 --replicas N`` (NoLoCo, H = 50).

Each swarm runs in a network namespace of its own, so its loopback counter gives every
byte its peers sent (payloads, DHT, libp2p and TCP/IP headers); we report that per
peer, plus the payload bytes swarm-node's transport counts. Weights are kept every H
steps and evaluated afterwards on the same validation windows, so the curves cost the
runs no time. Time counts from the launch of the swarm, start-up included."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench.common.curves import CurvePoint, Point, common_target, swarm_curve, time_to_target, value_at
from bench.common.results import Result, parse_mode, pyplot, rerun_command
from bench.common.sandbox import Sandbox
from bench.vs_hivemind.runs import Plan, SwarmRun, load_snapshots, run_hivemind, run_swarm_node
from swarm_node.config import suggested_lr
from swarm_node.data.dataset import load_windows
from swarm_node.data.spec import DataSpec
from swarm_node.local.swarm import LocalConfig
from swarm_node.model.config import model_config
from swarm_node.model.stages import build_model
from swarm_node.train.evaluate import path_val_loss

NAME = "vs_hivemind"
EVAL_BATCHES = 4
STALL_FACTOR = 3  # a gap this many times the median is reported as a stall
CLOSE_SHARE = 0.01  # final losses closer than this share are called a tie
TARGET_MARGIN = 0.1  # the target sits this share of the way from the worse final loss back to the start
QUICK = Plan(peers=2, model="debug", steps=250, time_limit_s=120.0)
FULL = Plan(peers=4, model="debug", steps=1000, hivemind_modes=("local-updates", "grad-averaging"),
            time_limit_s=900.0)


def val_loss(model, data) -> float:
    """On the first half of the validation windows ``swarm-node local`` evaluates its
    peers with (the same for every method; half, to fit the quick budget)."""
    config = LocalConfig()
    return path_val_loss([model], data, batch_size=config.eval_batch_size, max_batches=EVAL_BATCHES)


def evaluate(run: SwarmRun, model, data) -> list[Point]:
    points = []
    for snap in load_snapshots(run):
        model.load_state_dict(snap["state"])
        points.append(Point(snap["replica"], snap["step"], snap["time_s"], val_loss(model, data),
                            snap.get("sync")))
    return points


def curve_rows(run: SwarmRun, points: list[Point], plan: Plan, initial: float) -> list[dict]:
    """The swarm's curve; it starts at the initial loss when training starts (swarm-node
    writes no checkpoint before its first round; a hivemind peer snapshots step 0)."""
    curve = swarm_curve(points, plan.peers, plan.inner_steps)
    if (not curve or curve[0].step > 0) and run.training_started_s is not None:
        curve.insert(0, CurvePoint(0, run.training_started_s, initial, plan.peers))
    rows = []
    for c in curve:
        wire = value_at(run.tx_samples, c.time_s)
        rows.append({"kind": "curve", "method": run.method, "step": c.step,
                     "tokens": int(c.step * plan.peers * plan.tokens_per_step), "time_s": round(c.time_s, 2),
                     "val_loss": round(c.val_loss, 4),
                     "wire_bytes_per_peer": None if wire is None else int(wire / plan.peers)})
    return rows


def at_step(curve: list[dict], step: float) -> dict:
    """The last point of ``curve`` at or before ``step`` (steps are means over peers)."""
    return [r for r in curve if r["step"] <= step + 0.5][-1]


def method_row(run: SwarmRun, curve: list[dict], target: float, plan: Plan, params: int,
               common_step: float) -> dict:
    points = [CurvePoint(r["step"], r["time_s"], r["val_loss"], plan.peers) for r in curve]
    reached = time_to_target(points, target)
    started = run.training_started_s
    wire_total = run.tx_samples[-1][1] if run.tx_samples else None
    return {"kind": "method", "method": run.method, "peers": plan.peers, "tokens": run.info["tokens"],
            "final_step": common_step, "final_val_loss": at_step(curve, common_step)["val_loss"],
            "last_step": curve[-1]["step"], "incomplete": run.incomplete,
            "time_to_target_s": _round(reached),
            "train_time_to_target_s": None if reached is None or started is None else round(reached - started,
                                                                                            1),
            "startup_s": _round(started), "wall_s": round(run.wall_s, 1),
            "wire_bytes_per_peer": None if wire_total is None else int(wire_total / plan.peers),
            "wire_bytes_to_target_per_peer": None if reached is None or wire_total is None
            else int(value_at(run.tx_samples, reached) / plan.peers),
            "payload_bytes_per_peer": payload_per_peer(run, plan, params), **longest_gap(curve),
            **{k: v for k, v in run.info.items() if k not in ("tokens", "app_bytes_sent")}}


def longest_gap(curve: list[dict]) -> dict:
    """The longest wait between two points of the curve (after the first), and its
    median: a stall shows as one gap many times the others."""
    gaps = sorted(((b["time_s"] - a["time_s"], a["step"], b["step"]) for a, b in zip(curve[1:], curve[2:])),
                  reverse=True)
    if not gaps:
        return {"longest_gap_s": None, "median_gap_s": None, "longest_gap_steps": None}
    longest = gaps[0]
    return {"longest_gap_s": round(longest[0], 1), "median_gap_s": round(gaps[len(gaps) // 2][0], 1),
            "longest_gap_steps": [longest[1], longest[2]]}


def payload_per_peer(run: SwarmRun, plan: Plan, params: int) -> int:
    """swarm-node: what its transports counted. hivemind: its averaging rounds times what
    one peer sends in a butterfly all-reduce of the fp16 parameters (2 (N-1)/N of them)."""
    if "app_bytes_sent" in run.info:
        return int(sum(run.info["app_bytes_sent"]) / plan.peers)
    rounds_per_peer = run.info["averaged_rounds"] / plan.peers
    return int(rounds_per_peer * 2 * (plan.peers - 1) / plan.peers * params * 2)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def run_all(plan: Plan, work: Path) -> tuple[list[SwarmRun], list[list[Point]], dict]:
    lr = plan.lr or suggested_lr(plan.model)
    data = load_windows(DataSpec.parse(plan.data), plan.seq_len)
    model = build_model(model_config(plan.model, vocab_size=data.vocab_size, max_seq_len=plan.seq_len),
                        seed=plan.seed)
    names = [n for n, _ in model.named_parameters()]
    initial = val_loss(model, data)
    sandboxed = Sandbox.available()
    runs = []
    for index, method in enumerate(("swarm-node", *plan.hivemind_modes)):
        with ExitStack() as stack:
            box = stack.enter_context(Sandbox(f"run{index}")) if sandboxed else None
            if method == "swarm-node":
                runs.append(run_swarm_node(plan, work, box, names))
            else:
                runs.append(run_hivemind(plan, method, work, box, lr))
    points = [evaluate(run, model, data) for run in runs]
    setup = {"model": plan.model, "params": sum(p.numel() for p in model.parameters()), "peers": plan.peers,
             "steps_per_peer": plan.steps, "inner_steps": plan.inner_steps, "batch_size": plan.batch_size,
             "seq_len": plan.seq_len, "lr": lr, "matchmaking_s": plan.matchmaking_s,
             "averaging_timeout_s": plan.averaging_timeout_s, "sandboxed": sandboxed,
             "initial_val_loss": round(initial, 4),
             "eval_windows": EVAL_BATCHES * LocalConfig().eval_batch_size}
    return runs, points, setup


def build_result(result: Result, plan: Plan, runs: list[SwarmRun], points: list[list[Point]],
                 setup: dict) -> None:
    curves = [curve_rows(run, pts, plan, setup["initial_val_loss"]) for run, pts in zip(runs, points)]
    common_step = min(c[-1]["step"] for c in curves)  # equal tokens, also when a run was cut short
    target = common_target([at_step(c, common_step)["val_loss"] for c in curves], setup["initial_val_loss"],
                           TARGET_MARGIN)
    methods = [
        method_row(run, curve, target, plan, setup["params"], common_step) for run, curve in zip(runs, curves)
    ]
    result.rows = methods + [row for curve in curves for row in curve]
    ours, theirs = methods[0], methods[1]
    result.summary = {
        **setup,
        "target_val_loss": target,
        "target_margin": TARGET_MARGIN,
        "ours": ours["method"],
        "theirs": theirs["method"],
        "train_time_to_target_ratio": _ratio(
            theirs["train_time_to_target_s"], ours["train_time_to_target_s"]
        ),
        "time_to_target_ratio": _ratio(theirs["time_to_target_s"], ours["time_to_target_s"]),
        "wire_bytes_ratio": _ratio(theirs["wire_bytes_per_peer"], ours["wire_bytes_per_peer"]),
        "payload_bytes_ratio": _ratio(theirs["payload_bytes_per_peer"], ours["payload_bytes_per_peer"]),
        "final_val_loss_gap": round(theirs["final_val_loss"] - ours["final_val_loss"], 4),
        "extra_tokens_ours": round(ours["tokens"] / (plan.steps * plan.peers * plan.tokens_per_step) - 1, 4),
    }
    for note in NOTES:
        result.note(note)
    if plan.peers == 2:
        result.note(
            "With 2 peers a NoLoCo pair is the whole stage, so this is NoLoCo at its DiLoCo-like limit; its "
            "benefit over an all-reduce (no global barrier, see sync_cost and latency_model) needs more "
            "peers."
        )
    if not setup["sandboxed"]:
        result.note("not root or no iproute2: the swarms ran unsandboxed, so wire bytes were not measured")


NOTES = (
    "hivemind's inner lr follows the same per-step schedule as a swarm-node node (set on its AdamW before "
    "each step); its docs would step a scheduler per epoch, holding the lr for a whole epoch. So the inner "
    "optimizers are identical and only the synchronisation differs.",
    "swarm-node's nodes write a checkpoint after every round here (that is where the curve comes from); a "
    "plain `swarm-node local` run does not, so its times are slightly pessimistic.",
    "Start-up: until the last swarm-node node logs that it is ready to train, or the last hivemind peer has "
    "built its Optimizer. `swarm-node local` starts its bootstrap DHT before its nodes; our hivemind harness "
    "starts the bootstrap and the peers at once. The training-time column subtracts start-up.",
    "hivemind's ProgressTracker starts an epoch when the swarm's estimated sample count says so, and a peer "
    "that finishes first leaves while the other may be averaging with it; its last point can come late.",
    "The hivemind payload is an estimate (averaging rounds x the butterfly share of the fp16 parameters); "
    "the wire columns are measured for both.",
)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def plot(result: Result) -> None:
    plt = pyplot()
    fig, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    curves = [r for r in result.rows if r["kind"] == "curve"]
    for method in dict.fromkeys(r["method"] for r in curves):
        mine = [r for r in curves if r["method"] == method and r["step"] > 0]  # the start squashes the axis
        by_time.plot([r["time_s"] for r in mine], [r["val_loss"] for r in mine], marker="o", ms=3,
                     label=method)
        if mine[0]["wire_bytes_per_peer"] is not None:
            by_bytes.plot([r["wire_bytes_per_peer"] / 1e6 for r in mine], [r["val_loss"] for r in mine],
                          marker="o", ms=3, label=method)
    for ax, xlabel in ((by_time, "seconds since launch (start-up included)"), (by_bytes, "MB sent per peer")):
        ax.axhline(result.summary["target_val_loss"], color="grey", ls="--", lw=1, label="target")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.legend()
    fig.suptitle(f"{result.summary['peers']} peers, model {result.summary['model']}, equal tokens "
                 f"(both start at {result.summary['initial_val_loss']:.2f})")
    fig.tight_layout()
    fig.savefig(result.path(".png"), dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_mode(__doc__.split("\n\n")[0], argv)
    plan = FULL if args.mode == "full" else QUICK
    result = Result(NAME, args.mode, args.out_dir)
    work = Path(tempfile.mkdtemp(prefix="sbe-vs-hivemind-"))
    try:
        runs, points, setup = run_all(plan, work)
        build_result(result, plan, runs, points, setup)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    plot(result)
    result.write()
    return 0


def _mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e6:.2f}"


def _num(x, fmt: str = "{:.1f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _method_table(methods: list[dict], target: float) -> list[str]:
    step = methods[0]["final_step"]
    lines = [
        f"| method | tokens trained | val loss at step {step:.0f} | time to {target:.2f} (s) "
        "| of which training (s) | start-up (s) | wall (s) | MB sent per peer, wire | of which to the target "
        "| MB per peer, payload | rounds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in methods:
        if "rounds_with_partner" in m:
            rounds = f"{sum(m['rounds_with_partner'])} pair rounds, {sum(m['local_only_rounds'])} local-only"
        else:
            rounds = (f"{m['averaged_rounds']} averaged, {m['failed_rounds']} failed, "
                      f"{m['state_downloads']} state downloads")
        lines.append(
            f"| {m['method']} | {m['tokens']:,} | {m['final_val_loss']:.4f} | "
            f"{_num(m['time_to_target_s'])} | {_num(m['train_time_to_target_s'])} | {_num(m['startup_s'])} "
            f"| {m['wall_s']:.1f} | {_mb(m['wire_bytes_per_peer'])} | "
            f"{_mb(m['wire_bytes_to_target_per_peer'])} | {_mb(m['payload_bytes_per_peer'])} | "
            f"{rounds} (all peers) |"
        )
    return lines


def _faster(ratio: float) -> str:
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"




def _meaning(s: dict, methods: list[dict]) -> str:
    ours, theirs = methods[0], methods[1]
    parts = [
        f"{m['method']} was stopped at its time limit ({m['incomplete']}); its figures run to step "
        f"{m['last_step']:.0f}, and the losses are compared at step {m['final_step']:.0f}, where both were."
        for m in methods
        if m["incomplete"]
    ]
    if s["train_time_to_target_ratio"] is not None:
        parts.append(
            f"{ours['method']} reached the target validation loss {s['target_val_loss']:.2f} "
            f"{_faster(s['train_time_to_target_ratio'])} than {theirs['method']} counting training time, "
            f"{_faster(s['time_to_target_ratio'])} counting from the launch."
        )
    for m in methods:
        if m["longest_gap_s"] and m["median_gap_s"] and m["longest_gap_s"] > STALL_FACTOR * m["median_gap_s"]:
            a, b = m["longest_gap_steps"]
            why = (f" (its logs: failed averaging rounds {m['failed_rounds']}, state downloads "
                   f"{m['state_downloads']})" if "failed_rounds" in m else "")
            parts.append(
                f"{m['method']} stalled {m['longest_gap_s']:.0f} s between steps {a:.0f} and {b:.0f}, "
                f"against a median of {m['median_gap_s']:.1f} s per {s['inner_steps']} steps{why}."
            )
    gap = s["final_val_loss_gap"]
    if abs(gap) < CLOSE_SHARE * ours["final_val_loss"]:
        parts.append(f"At equal steps the final losses differ by only {abs(gap):.4f} (under "
                     f"{CLOSE_SHARE:.0%}); one short run cannot rank them.")
    elif gap < 0:
        rounds = sum(ours.get("rounds_with_partner", [])) / s["peers"]
        parts.append(
            f"At equal steps {theirs['method']} ended lower, by {-gap:.4f} in validation loss, short of "
            f"hivemind here: it averaged {theirs['averaged_rounds'] / s['peers']:.1f} times per peer "
            f"against NoLoCo's {rounds:.1f} rounds, and a plain average moves all the way to the mean "
            "where NoLoCo's outer step moves part of the way (outer lr 0.7, momentum 0.5); at this short "
            "length that is the likely cause."
        )
    else:
        parts.append(f"At equal steps {ours['method']} ended lower, by {gap:.4f} in validation loss.")
    planned = s["steps_per_peer"] / s["inner_steps"]
    for m in methods[1:]:
        per_peer = m["averaged_rounds"] / s["peers"]
        if per_peer > 1.5 * planned:
            parts.append(
                f"{m['method']} averaged {per_peer:.1f} times per peer where its `target_batch_size` asks "
                f"for {planned:.0f}: its ProgressTracker extrapolates the peers' sample rates, and keeps "
                f"counting while they wait for an averaging round, so short epochs come faster and faster."
            )
    if s["extra_tokens_ours"]:
        parts.append(f"swarm-node trained {s['extra_tokens_ours']:.1%} more tokens than its steps x batch "
                     "(micro-batches that finish during a round join the next step).")
    if s["wire_bytes_ratio"] is not None:
        parts.append(
            f"On the wire, {theirs['method']} sent {s['wire_bytes_ratio']:.2f}x the bytes per peer of "
            f"{ours['method']} (payload alone: {_num(s['payload_bytes_ratio'], '{:.2f}')}x); for a "
            "model this small most of hivemind's traffic is its DHT progress reports and matchmaking, "
            "which do not grow with the model, while the payloads do."
        )
    return " ".join(parts)


def markdown(result: dict) -> str:
    s = result["summary"]
    methods = [r for r in result["rows"] if r["kind"] == "method"]
    hivemind = ", ".join(m["method"] for m in methods[1:])
    lines = [
        "## vs_hivemind: this project against hivemind.Optimizer",
        "",
        f"`{rerun_command(NAME, result['mode'])}` ({result['mode']} mode, {result['wall_s']:.0f} s)",
        "",
        f"{s['peers']} peers, each a separate process, train the project's Llama-style model `{s['model']}` "
        f"({s['params']:,} parameters, one full stage) on their shards of the bundled corpus: "
        f"{s['steps_per_peer']} steps of {s['batch_size']} x {s['seq_len']} tokens per peer, AdamW at peak "
        f"lr {s['lr']:g} with the same warm-up, cosine decay and clipping for both.",
        "",
        f"- this project: `swarm-node local --stages 1 --replicas {s['peers']}` (NoLoCo, H = "
        f"{s['inner_steps']}, "
        "phi and Delta in fp16);",
        f"- hivemind ({hivemind}): `hivemind.Optimizer` with its own DHT per peer, `target_batch_size` = "
        f"peers x batch x {s['inner_steps']} (an epoch per {s['inner_steps']} local steps of every peer, as "
        f"often as NoLoCo's rounds), fp16 compression, `matchmaking_time` {s['matchmaking_s']:g} s (its "
        f"docs: 3-5 s for small local runs), `averaging_timeout` {s['averaging_timeout_s']:g} s (its docs: "
        f"about twice an all-reduce, 3-4 s here with matchmaking). `use_local_updates=True` steps AdamW "
        f"locally and averages parameters every epoch, the mode that matches a low-communication trainer; "
        f"the default mode (`grad-averaging`, full mode only) all-reduces gradients and takes one optimizer "
        f"step per epoch.",
        "",
        f"Weights were saved every {s['inner_steps']} steps and evaluated afterwards on the same "
        f"{s['eval_windows']} validation windows; a curve point is the mean over peers, at the time the last "
        f"peer got there. Bytes: each swarm ran in a network namespace of its own; its loopback counter "
        f"divided by the number of peers is every byte sent per peer (payloads, DHT, libp2p and TCP/IP "
        f"headers, bootstrap included). The payload column is what swarm-node's transports counted.",
        "",
        *_method_table(methods, s["target_val_loss"]),
        "",
        f"Target: the worse of the final losses plus {s['target_margin']:.0%} of the way back to the start "
        f"({s['initial_val_loss']:.4f}), rounded up, so that a method's last point, which can come late for "
        "reasons other than training (a partner that already left), does not decide it.",
        "",
        "![val loss vs time and bytes](bench/results/vs_hivemind.png)",
        "",
        _meaning(s, methods),
    ]
    if result["notes"]:
        lines += ["", "Notes:", "", *[f"- {n}" for n in result["notes"]]]
    return "\n".join(lines) + "\n"

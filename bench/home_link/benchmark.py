"""Benchmark: volunteers on home links. Each volunteer is a host of its own in the
multi-host test bed (tests/netbed: a network namespace, its uplink and downlink shaped
with ``tc tbf``, 50 ms of round trip through the bed's latency stage), and trains the
whole model (one stage) with the others through the bootstrap's join line, to the same
number of inner steps in every scenario:

- blocking fp16: the outer round as before issue 16 (the steps stop for the whole round,
  phi and Delta in 16 bits, one payload after the other);
- overlapped fp16 (full mode): the round runs beside the inner steps (ALGORITHM.md 3.1);
- overlapped + compressed: and phi and Delta in the run's default codec (3.2);
- hivemind.Optimizer: its peers (local updates, parameters averaged every H local steps
  per peer as configured) training the same model on the same data, steps and schedule
  on the same links, stopped if they take over HIVEMIND_TIME_FACTOR times as long as the
  overlapped + compressed swarm (they sometimes average every step here): the target of
  the time-to-loss comparison is its final validation loss;
- overlapped + compressed at 2 Mbit/s: the slowest link we claim to work on;
- NoLoCo and DiLoCo, both overlapped + compressed as the node runs them, among 4
  volunteers (a DiLoCo round with 2 is a pair's): each method's round cost as run here,
  for the convergence benchmark's time to a target loss;

and 2 stages x 2 volunteers, activations and their gradients in fp16 against int8
(the run spec's ``activation_codec``), at the same rate (quick) and at 4x and 16x it
(full): the swarm's tokens/s.

The link rate is chosen so that the blocking 16-bit round takes at least 4 times as long
as the H inner steps between rounds (the ratio a consumer GPU on a home uplink sees, see
the notes). Per node: compute utilisation (wall time in forward, backward and inner
steps over the wall time it trained), the critical path of its rounds, the time its
steps stood still for rounds, bytes sent per round and per token (by the node, and into
its link), rounds with a partner; per scenario: tokens/s against one process training
the same model alone on this machine, the final validation loss, and the validation
loss against time (weights kept every round, evaluated afterwards).

    .venv/bin/python -m bench.home_link [--full]

Quick: 2 volunteers, the tiny model, H = 50, 4 rounds (2 x 2: 50 steps). Full: 4 volunteers,
8 rounds (2 x 2: 100 steps).
``--work-dir DIR`` keeps every host's logs and files there."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common.curves import CurvePoint, Point, swarm_curve, time_to_target
from bench.common.procs import unwind_on_sigterm
from bench.common.results import Result, parse_mode, pyplot, rerun_command
from bench.common.snapshots import load_snapshots
from bench.home_link.plan import (
    DATA,
    FULL,
    HIVEMIND_TIME_FACTOR,
    METHOD_VOLUNTEERS,
    QUICK,
    RATIO,
    SLOW_RATE_MBIT,
    Plan,
    Scenario,
    StagedScenario,
    method_scenario,
    run_spec,
    scenarios,
    staged_scenarios,
)
from bench.home_link.swarms import RTT_MS, Ran, run_hivemind, run_one_stage, run_two_stages
from swarm_node.data.dataset import load_windows
from swarm_node.model.config import model_config
from swarm_node.model.stages import build_stage
from swarm_node.spec import RunSpec
from swarm_node.train.evaluate import path_val_loss
from swarm_node.train.worker import StageWorker
from swarm_node.wire.outer_codec import outer_codec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from netbed import unavailable

NAME = "home_link"
# batches of 64 validation windows, the same for every scenario; 8 cost a minute of the quick budget
EVAL_BATCHES = 4
LATE_PROPOSAL = "failed to answer a proposal"  # what the node logs when it backs a partner off for it


def alone(spec: RunSpec, steps: int) -> float:
    """Seconds per inner step of one process training the model alone, one thread (the
    first two steps warm up the allocator and are not counted)."""
    torch.set_num_threads(1)
    data = load_windows(spec.data, spec.seq_len)
    worker = StageWorker(spec, 0, data.vocab_size)
    g = torch.Generator().manual_seed(0)
    for step in range(steps + 2):
        if step == 2:
            started = time.perf_counter()
        tokens = torch.randint(0, data.vocab_size, (spec.batch_size, spec.seq_len + 1), generator=g)
        worker.forward_backward_last(None, tokens[:, 1:], tokens[:, :-1])
        worker.step()
    return (time.perf_counter() - started) / steps


def link_rate_mbit(spec: RunSpec, step_s: float, volunteers: int) -> float:
    """The rate at which the blocking fp16 round (both payloads, one after the other)
    takes RATIO times the H inner steps; the volunteers share this machine's 2 cores."""
    params = sum(p.numel() for p in StageWorker(spec, 0, 16).params)
    payload_bits = params * outer_codec("fp16").bytes_per_parameter() * 8
    inner_phase_s = spec.method.inner_steps * step_s * max(1.0, volunteers / 2)
    return round(2 * payload_bits / (RATIO * inner_phase_s) / 1e6, 2)


# -- evaluation ---------------------------------------------------------------------
class Evaluator:
    """Validation loss of one-stage weights on the same windows for every scenario."""

    def __init__(self, spec: RunSpec):
        self.data = load_windows(spec.data, spec.seq_len)
        config = model_config(spec.model_size, vocab_size=self.data.vocab_size, max_seq_len=spec.seq_len)
        self.stage = build_stage(config, num_stages=1, stage_index=0, seed=spec.seed)
        self.param_names = [name for name, _ in self.stage.named_parameters()]
        self.initial = self.loss(self.stage.state_dict())

    def loss(self, state: dict) -> float:
        """Between scenarios, when no volunteer runs: on every core."""
        torch.set_num_threads(os.cpu_count() or 1)
        self.stage.load_state_dict(state)
        return path_val_loss([self.stage], self.data, batch_size=64, max_batches=EVAL_BATCHES,
                             device=torch.device("cpu"))

    def curve(self, ran: Ran, volunteers: int, inner_steps: int) -> list[CurvePoint]:
        """The swarm's mean validation loss at each round, against the seconds since the
        last volunteer began to train (start-up is not counted: it differs by program)."""
        points = [Point(s["replica"], s["step"], s["time_s"], self.loss(s["state"]), s["sync"])
                  for s in load_snapshots(ran.snapshot_dir, ran.launched) if s["step"] > 0]
        start = ran.training_started_s or 0.0
        curve = [CurvePoint(0, 0.0, self.initial, volunteers)]
        curve += [CurvePoint(c.step, max(0.0, c.time_s - start), c.val_loss, c.peers)
                  for c in swarm_curve(points, volunteers, inner_steps)]
        return curve


# -- rows ---------------------------------------------------------------------------
def one_stage_row(plan: Plan, scenario: Scenario, rate: float, workdir: Path, alone_tokens_per_s: float,
                  evaluator: Evaluator, time_limit_s: float) -> dict:
    workdir = workdir / scenario.name.replace(" ", "-").replace("+", "and").replace("/", "")
    workdir.mkdir(parents=True, exist_ok=True)
    rate = scenario.rate_mbit or rate
    named = "" if scenario.rate_mbit else f" at {rate} Mbit/s"  # a scenario of its own rate names it
    print(f"bench.{NAME}: {scenario.name}{named}", file=sys.stderr, flush=True)
    spec = run_spec(plan, scenario.codec, method=scenario.method)
    if scenario.hivemind:
        ran = run_hivemind(spec, plan.volunteers, rate, workdir, DATA, time_limit_s)
        return hivemind_row(plan, scenario, rate, ran, alone_tokens_per_s, evaluator)
    volunteers = scenario.volunteers or plan.volunteers
    ran = run_one_stage(spec, volunteers, rate, workdir, blocking=scenario.blocking,
                        param_names=evaluator.param_names,
                        params=sum(p.numel() for p in evaluator.stage.parameters()))
    nodes = ran.nodes
    rounds = [max(1, n["outer_rounds"]) for n in nodes]
    partnered = [max(1, n["rounds_with_partner"]) for n in nodes]
    logs = [(workdir / f"v{i}" / "join.log").read_text(errors="replace") for i in range(volunteers)]
    curve = evaluator.curve(ran, volunteers, plan.inner_steps)
    tokens_per_step = spec.batch_size * spec.seq_len
    return dict(
        scenario=scenario.name, method=scenario.method, volunteers=volunteers, codec=scenario.codec,
        rate_mbit=rate,
        # a volunteer's inner step here, compute only (the volunteers share the machine's cores)
        step_s=round(statistics.mean(n["training_s"] / max(1, n["tokens"] // tokens_per_step) for n in nodes),
                     4),
        compute_utilisation=[round(n["training_s"] / n["training_wall_s"], 3) for n in nodes],
        held_s_per_round=[round(n["round_held_s"] / r, 1) for n, r in zip(nodes, rounds)],
        critical_path_s=[_critical_path(n, r, p) for n, r, p in zip(nodes, rounds, partnered)],
        bytes_per_round=[round(n["bytes_sent"] / r) for n, r in zip(nodes, rounds)],
        # what one exchange costs: local-only rounds send no payload
        bytes_per_partner_round=[round(n["bytes_sent"] / p) for n, p in zip(nodes, partnered)],
        wire_bytes_per_round=[round(b / r) for b, r in zip(ran.tx_bytes, rounds)],
        bytes_per_token=[round(n["bytes_sent"] / max(1, n["tokens"]), 2) for n in nodes],
        rounds_with_partner=[n["rounds_with_partner"] for n in nodes],
        local_only_rounds=[n["local_only_rounds"] for n in nodes],
        rounds_alone=[n["rounds_alone"] for n in nodes],  # nobody else left in the stage (the run's end)
        partners_backed_off_for_a_late_proposal_answer=sum(log.count(LATE_PROPOSAL) for log in logs),
        tokens_per_s_vs_alone=round(statistics.mean(n["tokens"] / n["training_wall_s"] for n in nodes)
                                    / alone_tokens_per_s, 3),
        wall_s=round(statistics.mean(n["training_wall_s"] for n in nodes), 1),
        final_val_loss=round(statistics.mean(evaluator.loss(torch.load(w, weights_only=True))
                                             for w in ran.weights), 4),
        curve=[[round(c.time_s, 2), round(c.val_loss, 4)] for c in curve])


def _critical_path(node: dict, rounds: int, partnered: int) -> dict:
    """A node's mean round: from the boundary to the outer step, and its parts."""
    return {"round": round(node["round_s"] / rounds, 2),
            "prepare": round(node["round_prepare_s"] / rounds, 2),
            "to_partner": round(node["round_to_partner_s"] / partnered, 2),
            "exchange": round(node["round_exchange_s"] / max(1, node["round_exchanges"]), 2),
            "close": round(node["round_close_s"] / rounds, 2),
            "waited_first": round(node.get("round_waited_first_s", 0.0) / rounds, 2)}


def hivemind_row(plan: Plan, scenario: Scenario, rate: float, ran: Ran, alone_tokens_per_s: float,
                 evaluator: Evaluator) -> dict:
    curve = evaluator.curve(ran, plan.volunteers, plan.inner_steps)
    steps = round(curve[-1].step)
    rounds = max(1, steps // plan.inner_steps)
    logs = "\n".join(n["log"] for n in ran.nodes)
    wall_s = curve[-1].time_s
    return dict(
        scenario=scenario.name, codec="fp16 all-reduce", rate_mbit=rate, steps=steps,
        stopped_at_time_limit=ran.stopped_at_limit,
        wire_bytes_per_round=[round(b / rounds) for b in ran.tx_bytes],
        averaged_rounds=logs.count("Averaged parameters with"), failed_rounds=logs.count("Averaging failed"),
        tokens_per_s_vs_alone=round(steps * plan.batch_size * plan.seq_len / wall_s / alone_tokens_per_s, 3),
        wall_s=round(wall_s, 1), final_val_loss=round(curve[-1].val_loss, 4),
        curve=[[round(c.time_s, 2), round(c.val_loss, 4)] for c in curve])


def staged_row(plan: Plan, staged: StagedScenario, rate: float, workdir: Path) -> dict:
    name = f"2x2 {staged.activation_codec} activations at {staged.rate_factor:g}x"
    workdir = workdir / name.replace(" ", "-")
    workdir.mkdir(parents=True, exist_ok=True)
    rate = round(rate * staged.rate_factor, 2)
    print(f"bench.{NAME}: {name} ({rate} Mbit/s)", file=sys.stderr, flush=True)
    spec = run_spec(plan, RunSpec().outer_codec, stages=2, activation_codec=staged.activation_codec)
    ran = run_two_stages(spec, rate, workdir, steps=plan.staged_steps)
    first = ran.nodes[0::2]
    return dict(scenario=name, activation_codec=staged.activation_codec, rate_mbit=rate,
                swarm_tokens_per_s=round(sum(n["tokens"] / n["training_wall_s"] for n in first), 1),
                microbatches_lost=sum(n["microbatches_lost"] for n in first),
                bytes_per_token=round(sum(n["bytes_sent"] for n in ran.nodes)
                                      / max(1, sum(n["tokens"] for n in first)), 1))


def time_to_loss(ours: dict, theirs: dict) -> dict:
    """Training seconds until each reaches the other's final validation loss (hivemind's
    final loss is the target the acceptance names)."""
    def curve(row: dict) -> list[CurvePoint]:
        return [CurvePoint(0, t, loss, 0) for t, loss in row["curve"]]

    target = theirs["final_val_loss"]
    return {"target": target, "ours_s": _maybe_round(time_to_target(curve(ours), target)),
            "theirs_s": _maybe_round(time_to_target(curve(theirs), target))}


def _maybe_round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_mode(__doc__.split("\n\n")[0], argv, extra=lambda p: p.add_argument(
        "--work-dir", type=Path, default=None, help="keep the hosts' logs and files here (default: removed)"))
    why = unavailable()
    if why:
        print(f"bench.{NAME}: {why}", file=sys.stderr)
        return 2
    unwind_on_sigterm()  # the test beds remove their hosts, and the nodes in them
    plan = FULL if args.full else QUICK
    result = Result(NAME, args.mode, args.out_dir)
    base = run_spec(plan, "fp16")
    step_s = alone(base, 20)
    rate = link_rate_mbit(base, step_s, plan.volunteers)
    tokens_per_step = base.batch_size * base.seq_len
    params = sum(p.numel() for p in StageWorker(base, 0, 16).params)
    evaluator = Evaluator(base)
    result.note(
        f"Link: {rate} Mbit/s each way per volunteer, {RTT_MS:.0f} ms round trip between volunteers. "
        f"The {plan.model} model has {params / 1e6:.2f}M parameters: a 16-bit round sends "
        f"{4 * params / 1e6:.1f} MB each way, {2 * 4 * params * 8 / rate / 1e6:.0f} s for both payloads "
        f"one after the other, against H = {plan.inner_steps} steps of {step_s:.2f} s alone "
        f"({plan.volunteers} volunteers share 2 cores). A volunteer with one 60M-parameter stage on a "
        f"consumer GPU (50 steps in 5-10 s) and a 20 Mbit/s uplink sees 240 MB: about 100 s, 10 times "
        "its inner phase."
    )
    with tempfile.TemporaryDirectory(prefix="home-link-") as tmp:
        workdir = args.work_dir or Path(tmp)
        time_limit_s = float("inf")
        for scenario in scenarios(args.full):
            row = one_stage_row(plan, scenario, rate, workdir, tokens_per_step / step_s, evaluator,
                                time_limit_s)
            result.add(**row)
            if scenario.name == "overlapped + compressed":
                time_limit_s = HIVEMIND_TIME_FACTOR * row["wall_s"]
            print(f"bench.{NAME}: {_brief(row)}", file=sys.stderr, flush=True)
        for staged in staged_scenarios(args.full):
            result.add(**staged_row(plan, staged, rate, workdir))
            print(f"bench.{NAME}: {result.rows[-1]}", file=sys.stderr, flush=True)
    result.summary = summary(result.rows, rate, plan, args.full) | link_in_steps(params, rate, step_s, plan)
    result.note(f"Re-run: {rerun_command(NAME, args.mode)}")
    result.write()
    plot(result)
    return 0


def _brief(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "curve"}


def link_in_steps(params: int, rate_mbit: float, step_s: float, plan: Plan) -> dict:
    """The link as the convergence benchmark's wall-clock model reads it: one 16-bit copy
    of the stage's weights over it, and a volunteer's inner step (volunteers share the
    machine's 2 cores), in seconds."""
    return {"payload_s_fp16": round(params * 2 * 8 / (rate_mbit * 1e6), 3),
            "volunteer_step_s": round(step_s * max(1.0, plan.volunteers / 2), 4)}


def summary(rows: list[dict], rate: float, plan: Plan, full: bool) -> dict:
    by_name = {r["scenario"]: r for r in rows}
    blocking, best, hive = (
        by_name["blocking fp16"],
        by_name["overlapped + compressed"],
        by_name["hivemind.Optimizer"],
    )
    slow = by_name[f"overlapped + compressed at {SLOW_RATE_MBIT:g} Mbit/s"]
    # rounds that could have had a partner: not those with nobody else left in the stage
    slow_rounds = (
        sum(slow["rounds_with_partner"]) + sum(slow["local_only_rounds"]) - sum(slow["rounds_alone"])
    )
    to_loss = time_to_loss(best, hive)
    return {
        "rate_mbit": rate, "inner_steps": plan.inner_steps, "volunteers": plan.volunteers,
        "utilisation_blocking_fp16": max(blocking["compute_utilisation"]),
        "utilisation_overlapped_compressed": min(best["compute_utilisation"]),
        "bytes_per_round_vs_blocking_fp16": round(statistics.mean(best["bytes_per_partner_round"])
                                                   / statistics.mean(blocking["bytes_per_partner_round"]), 3),
        "final_loss_vs_blocking_fp16": round(best["final_val_loss"] / blocking["final_val_loss"] - 1, 4),
        "time_to_hivemind_final_loss": to_loss,
        "time_to_hivemind_final_loss_ratio": None if to_loss["ours_s"] is None or not to_loss["theirs_s"]
        else round(to_loss["ours_s"] / to_loss["theirs_s"], 3),
        "slow_link_rounds_with_partner_share": round(sum(slow["rounds_with_partner"]) / max(1, slow_rounds),
                                                     3),
        "slow_link_partners_backed_off_for_late_proposal_answers":
            slow["partners_backed_off_for_a_late_proposal_answer"],
        "int8_activations_tokens_per_s_gain": {
            f"{factor:g}x": round(by_name[f"2x2 int8 activations at {factor:g}x"]["swarm_tokens_per_s"]
                                  / by_name[f"2x2 fp16 activations at {factor:g}x"]["swarm_tokens_per_s"], 3)
            for factor in sorted({s.rate_factor for s in staged_scenarios(full)})},
        "rounds_as_run_here": {m: round_as_run(by_name[method_scenario(m)], plan.inner_steps)
                               for m in ("noloco", "diloco") if method_scenario(m) in by_name}}


def round_as_run(row: dict, inner_steps: int) -> dict:
    """One method's round as the node ran it, what the convergence benchmark's wall-clock
    model charges it: the round (boundary to outer step: the steps go on beside all of
    it, and wait at the next boundary only if it is not over), the inner phase beside
    it, and the compute utilisation."""
    return {"volunteers": row["volunteers"], "inner_steps": inner_steps,
            "round_s": round(statistics.mean(c["round"] for c in row["critical_path_s"]), 2),
            "inner_phase_s": round(row["step_s"] * inner_steps, 1),
            "utilisation": min(row["compute_utilisation"]),
            "held_s_per_round": round(statistics.mean(row["held_s_per_round"]), 1),
            "bytes_per_partner_round": round(statistics.mean(row["bytes_per_partner_round"]))}


def plot(result: Result) -> None:
    plt = pyplot()
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4))
    ours = [r for r in result.rows if "compute_utilisation" in r]
    values = [statistics.mean(r["compute_utilisation"]) for r in ours]
    bars.bar([r["scenario"].replace(" at ", "\nat ") for r in ours], values,
             color=["#999999", "#6699cc", "#336699", "#223366", "#66aa66", "#aa6633"][:len(ours)])
    bars.set_ylim(0, 1)
    bars.set_ylabel("compute utilisation")
    bars.set_title(f"home links: {result.summary['rate_mbit']} Mbit/s, {RTT_MS:.0f} ms RTT")
    bars.tick_params(axis="x", labelsize=7)
    for i, v in enumerate(values):
        bars.text(i, v + 0.02, f"{v:.0%}", ha="center")
    for row in (r for r in result.rows if "curve" in r):
        times, losses = zip(*row["curve"])
        curves.plot(times, losses, marker=".", label=row["scenario"])
    curves.set_xlabel("seconds of training")
    curves.set_ylabel("validation loss")
    curves.set_title("validation loss against time (the same steps, or hivemind's time limit)")
    curves.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(result.path(".png"), dpi=100)


def markdown(result: dict) -> str:
    s = result["summary"]
    one_stage = [r for r in result["rows"] if "curve" in r]
    lines = [
        "## home_link: volunteers on shaped home links",
        "",
        f"`{rerun_command(NAME, result['mode'])}` ({result['mode']} mode, {result['wall_s']:.0f} s)",
        "",
        f"{s['volunteers']} volunteers, each a host of its own in the multi-host test bed (a network "
        f"namespace; its uplink and downlink shaped to {s['rate_mbit']} Mbit/s with `tc tbf` unless the row "
        f"says otherwise, {RTT_MS:.0f} ms round trip between volunteers), train the whole model (one stage) "
        f"with the others through the bootstrap's join line, one torch thread each, and stop at the same "
        f"inner step in every scenario; each writes a checkpoint after every round. Compute utilisation: "
        f"wall time in forward, backward and inner steps over the wall time from the start of training to "
        f"the last inner step. Held: how long the node's steps stood still for each round. Bytes: what the "
        f"node sent (its payloads and messages) per round with a partner, and everything its host sent into "
        f"its link per round. Tokens/s: per node, against one process training the same model alone on this "
        f"machine (the volunteers share its 2 cores with their daemons and the bed's latency stage; with 4 "
        f"volunteers 0.5 is the most each can get).",
        "",
        "| scenario | phi and Delta | compute utilisation | held per round | bytes sent per round with a "
        "partner | into the link per round | rounds with a partner / local (alone) | tokens/s vs alone | "
        "final val loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in one_stage if "compute_utilisation" in r):
        partners = ", ".join(f"{p}/{lo} ({al})" for p, lo, al in zip(r["rounds_with_partner"],
                                                                     r["local_only_rounds"],
                                                                     r["rounds_alone"]))
        lines.append(
            f"| {r['scenario']} | {r['codec']} | {', '.join(f'{u:.0%}' for u in r['compute_utilisation'])} | "
            f"{', '.join(f'{h:.1f} s' for h in r['held_s_per_round'])} | "
            f"{', '.join(f'{b / 1e6:.2f} MB' for b in r['bytes_per_partner_round'])} | "
            f"{', '.join(f'{b / 1e6:.2f} MB' for b in r['wire_bytes_per_round'])} | {partners} | "
            f"{r['tokens_per_s_vs_alone']:.2f} | {r['final_val_loss']:.4f} |")
    hive = next(r for r in one_stage if "averaged_rounds" in r)
    stopped = (
        f"; stopped at {HIVEMIND_TIME_FACTOR:g} times the wall time of the overlapped and compressed swarm"
        if hive["stopped_at_time_limit"]
        else ""
    )
    lines += [
        "",
        f"hivemind.Optimizer on the same links (the same steps and schedule, local updates, parameters "
        f"averaged in fp16 by all-reduce, as its docs set it up for a small run{stopped}):",
        "",
        "| steps | training wall time | tokens/s vs alone | into the link per H steps | averaging rounds "
        "(all peers) | final val loss |",
        "|---|---|---|---|---|---|",
        f"| {hive['steps']} | {hive['wall_s']:.0f} s | {hive['tokens_per_s_vs_alone']:.2f} | "
        f"{', '.join(f'{b / 1e6:.1f} MB' for b in hive['wire_bytes_per_round'])} | "
        f"{hive['averaged_rounds']} averaged, {hive['failed_rounds']} failed | "
        f"{hive['final_val_loss']:.4f} |",
    ]
    lines += [
        "",
        "The critical path of a round, per node (mean seconds: the whole round from the boundary to the "
        "outer step; preparing the payload; finding the partner; both payloads moving; the outer step; the "
        "steps held after the boundary for the partner's Delta, when the last exchange outlasted its steps):",
        "",
        "| scenario | round | prepare | to partner | exchange | close | waited first |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in one_stage if "critical_path_s" in r):
        cells = [", ".join(f"{c.get(k, 0.0):.2f}" for c in r["critical_path_s"])
                 for k in ("round", "prepare", "to_partner", "exchange", "close", "waited_first")]
        lines.append(f"| {r['scenario']} | {' | '.join(cells)} |")
    to_loss = s["time_to_hivemind_final_loss"]
    lines += [
        "",
        f"![compute utilisation and loss against time](bench/results/{NAME}.png)",
        "",
        f"Overlapped and compressed rounds keep compute utilisation at "
        f"{s['utilisation_overlapped_compressed']:.0%} or more on every node, against at most "
        f"{s['utilisation_blocking_fp16']:.0%} for the blocking 16-bit round on the same links; they send "
        f"{s['bytes_per_round_vs_blocking_fp16']:.2f}x its bytes per round with a partner; the final loss "
        f"differs by {s['final_loss_vs_blocking_fp16']:+.1%}. hivemind.Optimizer's final validation loss, "
        f"{to_loss['target']:.4f}, is reached after {_seconds(to_loss['ours_s'])} of training by swarm-node "
        f"and {_seconds(to_loss['theirs_s'])} by hivemind "
        f"({_ratio(s['time_to_hivemind_final_loss_ratio'])}). At {SLOW_RATE_MBIT:g} Mbit/s "
        f"{s['slow_link_rounds_with_partner_share']:.0%} of the rounds had a partner (of those with another "
        f"peer in the stage: alone, a node takes the local-only step at once, as at the end of a run) and "
        f"{s['slow_link_partners_backed_off_for_late_proposal_answers']} partners were backed off for a late "
        f"proposal answer.",
        "",
        *_rounds_as_run(s.get("rounds_as_run_here") or {}),
        "### Two stages x two volunteers: activations in fp16 against int8",
        "",
        f"The same links, the default outer codec, stage 0 stopping after {2 * s['inner_steps']} inner steps "
        f"(H = {s['inner_steps']}). "
        "Tokens/s: the two stage-0 volunteers' together, from the start of training to their last step.",
        "",
        "| activations | link | swarm tokens/s | micro-batches lost | bytes sent per token (all 4) |",
        "|---|---|---|---|---|",
        *[
            f"| {r['activation_codec']} | {r['rate_mbit']} Mbit/s | {r['swarm_tokens_per_s']:,.0f} | "
            f"{r['microbatches_lost']} | {r['bytes_per_token']:,.0f} |"
            for r in result["rows"]
            if "swarm_tokens_per_s" in r
        ],
        "",
        "int8 activations against fp16, tokens/s: "
        + ", ".join(
            f"{gain:.2f}x at {factor} the rate"
            for factor, gain in s["int8_activations_tokens_per_s_gain"].items()
        )
        + ".",
    ]
    if result["notes"]:
        lines += ["", "Notes:", "", *[f"- {n}" for n in result["notes"]]]
    return "\n".join(lines) + "\n"


def _rounds_as_run(rounds: dict) -> list[str]:
    if not rounds:
        return []
    names = {"noloco": "NoLoCo (one random partner)", "diloco": "DiLoCo (every peer of the stage)"}
    lines = [
        f"### One round of each method as the node runs it, {METHOD_VOLUNTEERS} volunteers",
        "",
        "Both overlapped and compressed, on the same links, H = "
        f"{next(iter(rounds.values()))['inner_steps']}: what the convergence benchmark's time to a target "
        "loss charges each method's round on a home link.",
        "",
        "| method | round (boundary to outer step) | inner phase beside it | bytes sent per round with a "
        "partner | held per round | compute utilisation (lowest node) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {names[m]} | {r['round_s']:.1f} s | {r['inner_phase_s']:.1f} s | "
        f"{r['bytes_per_partner_round'] / 1e6:.2f} MB | {r['held_s_per_round']:.1f} s | "
        f"{r['utilisation']:.0%} |"
        for m, r in rounds.items()
    ]
    return [*lines, ""]


def _seconds(value: float | None) -> str:
    return "never (within its run)" if value is None else f"{value:.0f} s"


def _ratio(value: float | None) -> str:
    return "no ratio" if value is None else f"{value:.2f}x its time"

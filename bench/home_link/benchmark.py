"""Benchmark: volunteers on home links. Each volunteer is a host of its own in the
multi-host test bed (tests/netbed: a network namespace, its uplink and downlink shaped
with ``tc tbf``, 50 ms of round trip through the bed's latency stage), and trains the
whole model (one stage) with the others through the bootstrap's join line, to the same
number of inner steps in every scenario:

- blocking fp16: the outer round as before issue 16 (the steps stop for the whole round,
  phi and Delta in 16 bits);
- overlapped fp16: the round runs beside the inner steps (ALGORITHM.md 3.1);
- overlapped + compressed: and phi and Delta in the run's default codec (3.2);

and 2 stages x 2 volunteers, activations and their gradients in fp16 against int8
(the run spec's ``activation_codec``), at the same rate (quick) and at 4x and 16x it
(full): the swarm's tokens/s.

The link rate is chosen so that the blocking 16-bit round takes at least 4 times as long
as the H inner steps between rounds (the ratio a consumer GPU on a home uplink sees, see
the notes). Per node: compute utilisation (wall time in forward, backward and inner
steps over the wall time it trained), the time its steps stood still for rounds, bytes
sent per round and per token, rounds with a partner; per scenario: tokens/s against one
process training the same model alone on this machine, and the final validation loss.

    .venv/bin/python -m bench.home_link [--full]

Quick: 2 volunteers, the tiny model, H = 50, 6 rounds. Full: 4 volunteers, 8 rounds.
``--work-dir DIR`` keeps every host's logs and files there."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import ROOT
from bench.common.results import Result, parse_mode, pyplot, rerun_command

sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "multihost")]  # the test bed and its swarm helpers
from netbed import TestBed, unavailable  # noqa: E402
from swarm_hosts import BootstrapOnHost, Volunteer, wait_for  # noqa: E402

from swarm_node.data.dataset import load_windows  # noqa: E402
from swarm_node.data.spec import DataSpec  # noqa: E402
from swarm_node.model.config import model_config  # noqa: E402
from swarm_node.model.stages import build_stage  # noqa: E402
from swarm_node.optim import InnerHyper, default_method  # noqa: E402
from swarm_node.spec import RunSpec  # noqa: E402
from swarm_node.train.evaluate import path_val_loss  # noqa: E402
from swarm_node.train.worker import StageWorker  # noqa: E402
from swarm_node.wire.outer_codec import outer_codec  # noqa: E402

NAME = "home_link"
RTT_MS = 50.0  # between two volunteers: 25 ms on each one's access link
RATIO = 4.0  # the blocking 16-bit round at least this many times the H inner steps


@dataclass(frozen=True)
class Plan:
    volunteers: int
    rounds: int
    model: str = "tiny"
    inner_steps: int = 50
    seq_len: int = 64
    batch_size: int = 8


@dataclass(frozen=True)
class Scenario:
    name: str
    blocking: bool
    codec: str


def scenarios() -> list[Scenario]:
    return [Scenario("blocking fp16", True, "fp16"), Scenario("overlapped fp16", False, "fp16"),
            Scenario("overlapped + compressed", False, RunSpec().outer_codec)]


@dataclass(frozen=True)
class StagedScenario:
    activation_codec: str
    rate_factor: float  # times the 1-stage scenarios' rate


def staged_scenarios(full: bool) -> list[StagedScenario]:
    return [StagedScenario(codec, factor) for factor in ((1.0, 4.0, 16.0) if full else (1.0,))
            for codec in ("fp16", "int8")]


def run_spec(plan: Plan, codec: str, stages: int = 1, activation_codec: str = "fp16") -> RunSpec:
    steps = plan.rounds * plan.inner_steps
    return RunSpec(run_id=f"home-{codec}-{stages}-{activation_codec}", model_size=plan.model, num_stages=stages,
                   seq_len=plan.seq_len, batch_size=plan.batch_size, samples_per_step=plan.batch_size,
                   total_steps=steps, data=DataSpec(kind="synthetic", alphabet=16, order=2), outer_codec=codec,
                   activation_codec=activation_codec, method=default_method("noloco", inner_steps=plan.inner_steps),
                   inner=InnerHyper(lr=3e-3, warmup_steps=plan.inner_steps, total_steps=steps))


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


def run_scenario(plan: Plan, scenario: Scenario, rate_mbit: float, workdir: Path) -> dict:
    spec = run_spec(plan, scenario.codec)
    spec_path = workdir / "spec.json"
    spec.write_json(spec_path)
    steps = plan.rounds * plan.inner_steps
    with TestBed("hl") as bed:
        boot = BootstrapOnHost(bed, bed.add_host("boot"), workdir, "--run-spec", str(spec_path))
        line = boot.join_line()
        extra = ["--max-steps", str(steps), "--threads", "1", "--run-dir", "run", "--no-progress",
                 "--no-state-download", "--slowest-link-mbit", str(rate_mbit),
                 *(["--blocking-rounds"] if scenario.blocking else [])]
        volunteers = [Volunteer(bed, bed.add_host(f"v{i}", rate_mbit=rate_mbit, rtt_ms=RTT_MS / 2), workdir, line,
                                *extra, "--data-shard", f"{i}/{plan.volunteers}")
                      for i in range(plan.volunteers)]
        wait_for(lambda: all(v.process.poll() is not None for v in volunteers), 1800,
                 f"the {scenario.name} volunteers to finish {steps} steps", workdir)
        failed = [v.log for v in volunteers if v.process.returncode != 0]
        if failed:
            raise RuntimeError(f"volunteers failed: {', '.join(map(str, failed))}")
        nodes = [json.loads(next((v.workdir / "run").glob("summary-*.json")).read_text()) for v in volunteers]
        weights = [next((v.workdir / "run").glob("weights-*.pt")) for v in volunteers]
    return {"spec": spec, "nodes": nodes, "weights": weights}


def run_staged(plan: Plan, scenario: StagedScenario, rate_mbit: float, workdir: Path, steps: int) -> dict:
    """2 stages x 2 volunteers; stage 0 stops at ``steps``, then stage 1 is stopped."""
    spec = run_spec(plan, RunSpec().outer_codec, stages=2, activation_codec=scenario.activation_codec)
    spec_path = workdir / "spec.json"
    spec.write_json(spec_path)
    with TestBed("hs") as bed:
        boot = BootstrapOnHost(bed, bed.add_host("boot"), workdir, "--run-spec", str(spec_path))
        line = boot.join_line()
        volunteers = []
        for i in range(4):
            stage = i % 2
            extra = ["--stage", str(stage), "--threads", "1", "--run-dir", "run", "--no-progress",
                     "--no-state-download", "--slowest-link-mbit", str(rate_mbit)]
            if stage == 0:
                extra += ["--max-steps", str(steps), "--data-shard", f"{i // 2}/2"]
            host = bed.add_host(f"v{i}", rate_mbit=rate_mbit, rtt_ms=RTT_MS / 2)
            volunteers.append((stage, host, Volunteer(bed, host, workdir, line, *extra)))
        firsts = [v for stage, _, v in volunteers if stage == 0]
        wait_for(lambda: all(v.process.poll() is not None for v in firsts), 1800,
                 f"stage 0 to finish {steps} steps", workdir)
        bed.stop_processes(*(host for stage, host, _ in volunteers if stage == 1))
        nodes = [json.loads(next((v.workdir / "run").glob("summary-*.json")).read_text()) for _, _, v in volunteers]
    return {"first": [n for n, (stage, _, _) in zip(nodes, volunteers) if stage == 0], "all": nodes}


def final_loss(spec: RunSpec, weights: list[Path]) -> float:
    data = load_windows(spec.data, spec.seq_len)
    config = model_config(spec.model_size, vocab_size=data.vocab_size, max_seq_len=spec.seq_len)
    losses = []
    for path in weights:
        stage = build_stage(config, num_stages=1, stage_index=0, seed=spec.seed)
        stage.load_state_dict(torch.load(path, weights_only=True))
        losses.append(path_val_loss([stage], data, batch_size=64, max_batches=8, device=torch.device("cpu")))
    return statistics.mean(losses)


def one_stage_row(plan: Plan, scenario: Scenario, rate: float, workdir: Path, alone_tokens_per_s: float) -> dict:
    workdir = workdir / scenario.name.replace(" ", "-").replace("+", "and")
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"bench.{NAME}: {scenario.name} at {rate} Mbit/s", file=sys.stderr, flush=True)
    ran = run_scenario(plan, scenario, rate, workdir)
    nodes = ran["nodes"]
    rounds = [max(1, n["outer_rounds"]) for n in nodes]
    return dict(
        scenario=scenario.name, codec=scenario.codec, rate_mbit=rate,
        compute_utilisation=[round(n["training_s"] / n["training_wall_s"], 3) for n in nodes],
        held_s_per_round=[round(n["round_held_s"] / r, 1) for n, r in zip(nodes, rounds)],
        bytes_per_round=[round(n["bytes_sent"] / r) for n, r in zip(nodes, rounds)],
        # what one exchange costs: local-only rounds send no payload
        bytes_per_partner_round=[round(n["bytes_sent"] / max(1, n["rounds_with_partner"])) for n in nodes],
        bytes_per_token=[round(n["bytes_sent"] / max(1, n["tokens"]), 2) for n in nodes],
        rounds_with_partner=[n["rounds_with_partner"] for n in nodes],
        local_only_rounds=[n["local_only_rounds"] for n in nodes],
        tokens_per_s_vs_alone=round(statistics.mean(n["tokens"] / n["training_wall_s"] for n in nodes)
                                    / alone_tokens_per_s, 3),
        wall_s=round(statistics.mean(n["training_wall_s"] for n in nodes), 1),
        final_val_loss=round(final_loss(ran["spec"], ran["weights"]), 4))


def staged_row(plan: Plan, staged: StagedScenario, rate: float, workdir: Path) -> dict:
    name = f"2x2 {staged.activation_codec} activations at {staged.rate_factor:g}x"
    workdir = workdir / name.replace(" ", "-")
    workdir.mkdir(parents=True, exist_ok=True)
    rate = round(rate * staged.rate_factor, 2)
    print(f"bench.{NAME}: {name} ({rate} Mbit/s)", file=sys.stderr, flush=True)
    ran = run_staged(plan, staged, rate, workdir, steps=2 * plan.inner_steps)
    first = ran["first"]
    return dict(scenario=name, activation_codec=staged.activation_codec, rate_mbit=rate,
                swarm_tokens_per_s=round(sum(n["tokens"] / n["training_wall_s"] for n in first), 1),
                microbatches_lost=sum(n["microbatches_lost"] for n in first),
                bytes_per_token=round(sum(n["bytes_sent"] for n in ran["all"])
                                      / max(1, sum(n["tokens"] for n in first)), 1))


def main(argv: list[str] | None = None) -> int:
    args = parse_mode(__doc__.split("\n\n")[0], argv, extra=lambda p: p.add_argument(
        "--work-dir", type=Path, default=None, help="keep the hosts' logs and files here (default: removed)"))
    why = unavailable()
    if why:
        print(f"bench.{NAME}: {why}", file=sys.stderr)
        return 2
    plan = Plan(volunteers=4, rounds=8) if args.full else Plan(volunteers=2, rounds=6)
    result = Result(NAME, args.mode, args.out_dir)
    base = run_spec(plan, "fp16")
    step_s = alone(base, 20)
    rate = link_rate_mbit(base, step_s, plan.volunteers)
    tokens_per_step = base.batch_size * base.seq_len
    params = sum(p.numel() for p in StageWorker(base, 0, 16).params)
    result.note(f"Link: {rate} Mbit/s each way per volunteer, {RTT_MS:.0f} ms round trip between volunteers. "
                f"The {plan.model} model has {params / 1e6:.2f}M parameters: a 16-bit round sends "
                f"{4 * params / 1e6:.1f} MB each way, {2 * 4 * params * 8 / rate / 1e6:.0f} s for both payloads "
                f"one after the other, against H = {plan.inner_steps} steps of {step_s:.2f} s alone "
                f"({plan.volunteers} volunteers share 2 cores). A volunteer with one 60M-parameter stage on a "
                f"consumer GPU (50 steps in 5-10 s) and a 20 Mbit/s uplink sees 240 MB: about 100 s, 10 times "
                "its inner phase.")
    with tempfile.TemporaryDirectory(prefix="home-link-") as tmp:
        workdir = args.work_dir or Path(tmp)
        for scenario in scenarios():
            result.add(**one_stage_row(plan, scenario, rate, workdir, tokens_per_step / step_s))
            print(f"bench.{NAME}: {result.rows[-1]}", file=sys.stderr, flush=True)
        for staged in staged_scenarios(args.full):
            result.add(**staged_row(plan, staged, rate, workdir))
            print(f"bench.{NAME}: {result.rows[-1]}", file=sys.stderr, flush=True)
    rows = {r["scenario"]: r for r in result.rows}
    blocking, best = rows["blocking fp16"], rows["overlapped + compressed"]
    result.summary = {
        "rate_mbit": rate, "inner_steps": plan.inner_steps,
        "utilisation_blocking_fp16": max(blocking["compute_utilisation"]),
        "utilisation_overlapped_compressed": min(best["compute_utilisation"]),
        "bytes_per_round_vs_blocking_fp16": round(statistics.mean(best["bytes_per_partner_round"])
                                                   / statistics.mean(blocking["bytes_per_partner_round"]), 3),
        "final_loss_vs_blocking_fp16": round(best["final_val_loss"] / blocking["final_val_loss"] - 1, 4),
        "int8_activations_tokens_per_s_gain": {
            f"{factor:g}x": round(rows[f"2x2 int8 activations at {factor:g}x"]["swarm_tokens_per_s"]
                                  / rows[f"2x2 fp16 activations at {factor:g}x"]["swarm_tokens_per_s"], 3)
            for factor in sorted({s.rate_factor for s in staged_scenarios(args.full)})}}
    result.note(f"Re-run: {rerun_command(NAME, args.mode)}")
    result.write()
    plot(result)
    return 0


def plot(result: Result) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    one_stage = [r for r in result.rows if "compute_utilisation" in r]
    names = [r["scenario"] for r in one_stage]
    values = [statistics.mean(r["compute_utilisation"]) for r in one_stage]
    ax.bar(names, values, color=["#999999", "#6699cc", "#336699"][:len(names)])
    ax.set_ylim(0, 1)
    ax.set_ylabel("compute utilisation")
    ax.set_title(f"home links: {one_stage[0]['rate_mbit']} Mbit/s, {RTT_MS:.0f} ms RTT")
    for i, v in enumerate(values):
        ax.text(i, v + 0.02, f"{v:.0%}", ha="center")
    fig.tight_layout()
    fig.savefig(result.path(".png"), dpi=100)


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [
        "## home_link: volunteers on shaped home links", "",
        f"`{rerun_command(NAME, result['mode'])}` ({result['mode']} mode, {result['wall_s']:.0f} s)", "",
        "Every volunteer is a host of its own in the multi-host test bed (a network namespace; its uplink and "
        f"downlink shaped to {s['rate_mbit']} Mbit/s with `tc tbf`, {RTT_MS:.0f} ms round trip between "
        "volunteers), trains the whole model (one stage) with the others through the bootstrap's join line, "
        "one torch thread each, and stops at the same inner step in every scenario. Compute utilisation: wall "
        "time in forward, backward and inner steps over the wall time from the start of training to the last "
        "inner step. Held: how long the node's steps stood still for each round. Tokens/s: per node, against "
        "one process training the same model alone on this machine (the volunteers share its 2 cores with "
        "their daemons and the bed's latency stage; with 4 volunteers 0.5 is the most each can get).", "",
        "| scenario | phi and Delta | compute utilisation | held per round | bytes sent per round with a "
        "partner | bytes per token | rounds with a partner / local | tokens/s vs alone | final val loss |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in result["rows"] if "compute_utilisation" in r):
        partners = ", ".join(f"{p}/{lo}" for p, lo in zip(r["rounds_with_partner"], r["local_only_rounds"]))
        lines.append(
            f"| {r['scenario']} | {r['codec']} | {', '.join(f'{u:.0%}' for u in r['compute_utilisation'])} | "
            f"{', '.join(f'{h:.1f} s' for h in r['held_s_per_round'])} | "
            f"{', '.join(f'{b / 1e6:.2f} MB' for b in r['bytes_per_partner_round'])} | "
            f"{', '.join(f'{b:,.0f}' for b in r['bytes_per_token'])} | {partners} | "
            f"{r['tokens_per_s_vs_alone']:.2f} | {r['final_val_loss']:.4f} |")
    lines += [
        "", f"![compute utilisation](bench/results/{NAME}.png)", "",
        f"Overlapped and compressed rounds keep compute utilisation at {s['utilisation_overlapped_compressed']:.0%} "
        f"or more on every node, against at most {s['utilisation_blocking_fp16']:.0%} for the blocking 16-bit "
        f"round on the same links; they send {s['bytes_per_round_vs_blocking_fp16']:.2f}x its bytes per round "
        "with a partner; "
        f"the final loss differs by {s['final_loss_vs_blocking_fp16']:+.1%}.", "",
        "### Two stages x two volunteers: activations in fp16 against int8", "",
        f"The same links, the default outer codec, stage 0 stopping after {2 * s['inner_steps']} inner steps "
        f"(H = {s['inner_steps']}). "
        "Tokens/s: the two stage-0 volunteers' together, from the start of training to their last step.", "",
        "| activations | link | swarm tokens/s | micro-batches lost | bytes sent per token (all 4) |",
        "|---|---|---|---|---|",
        *[f"| {r['activation_codec']} | {r['rate_mbit']} Mbit/s | {r['swarm_tokens_per_s']:,.0f} | "
          f"{r['microbatches_lost']} | {r['bytes_per_token']:,.0f} |"
          for r in result["rows"] if "swarm_tokens_per_s" in r], "",
        "int8 activations against fp16, tokens/s: " + ", ".join(
            f"{gain:.2f}x at {factor} the rate" for factor, gain in s["int8_activations_tokens_per_s_gain"].items())
        + "."]
    if result["notes"]:
        lines += ["", "Notes:", "", *[f"- {n}" for n in result["notes"]]]
    return "\n".join(lines) + "\n"

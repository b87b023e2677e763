"""How the check of a downloaded state (swarm_node/state/check.py, docs/ALGORITHM.md
section 8) does on real replicas: in-process swarms of the simulator (debug model,
bundled corpus), at every round boundary every replica is a donor whose state is
checked against all the others' sketches (the joiner asks every live peer of the stage),
at once, a round behind them, and two steps into the next round; then issue 33's
hostile donor: theta and phi scaled by 1.5, noise at 10x the honest spread (per element,
the RMS over elements of the standard deviation across replicas), one tensor (the
largest) replaced by fresh initial values, a state 20 rounds old with today's counters,
another run's initial weights; and each of those again with one more identity of the
attacker among the witnesses, vouching for it (the witnesses' own partner spreads are
what the simulator's pairs measured before averaging).

    .venv/bin/python -m bench.state_check [--full]

Quick: 4 x 2 and 3 x 2 swarms at H = 5, 22 rounds. Full: also 2 x 2, 8 x 2, H = 10,
DiLoCo, overlapped rounds a round late. Also: what a sketch costs, per million
parameters of state, on this machine."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import swarm_node.sim.simulator as simulator
from bench.common.results import Result, run_mode
from bench.state_check.report import markdown, plot
from swarm_node.config import default_warmup_steps, suggested_lr
from swarm_node.data.spec import DataSpec
from swarm_node.model.config import model_config
from swarm_node.model.stages import build_stage
from swarm_node.optim.inner import InnerHyper
from swarm_node.optim.methods import default_method
from swarm_node.sim.config import SimConfig
from swarm_node.state.check import Witness, check_state
from swarm_node.state.sketch import sketch_state

__all__ = ["main", "markdown", "run"]

NAME = "state_check"
OLD_ROUNDS = 20
SPREAD_ROUNDS = 4  # the partner distances a witness keeps (gossip/partner_check.py)


@dataclass(frozen=True)
class Swarm:
    replicas: int
    inner_steps: int
    rounds: int = OLD_ROUNDS + 2
    method: str = "noloco"
    late: bool = False  # overlapped rounds landing half a round late

    @property
    def label(self) -> str:
        return (f"{self.replicas} x 2, H = {self.inner_steps}, {self.method}"
                + (", overlapped" if self.late else ""))


SWARMS = {"quick": (Swarm(4, 5), Swarm(3, 5)),
          "full": (Swarm(4, 5), Swarm(3, 5), Swarm(2, 5), Swarm(8, 5), Swarm(4, 10),
                   Swarm(4, 5, method="diloco"), Swarm(4, 5, late=True))}


@dataclass
class State:
    theta: list[torch.Tensor]
    phi: list[torch.Tensor]
    momentum: list[torch.Tensor]
    step: int
    inner_steps: int
    outer_round: int  # outer steps landed (overlapped: a round's lands after the next one opened)

    def sketch(self, seed: int):
        return sketch_state(self.theta, self.phi, self.momentum, inner_step=self.step,
                            outer_round=self.outer_round,
                            round_steps=self.step % self.inner_steps, seed=seed)


def trained(swarm: Swarm, seed: int = 0) -> tuple[dict, dict, simulator.Simulator]:
    """states[(stage, replica)][step] after each round and two steps into it; spread[(stage,
    replica)][step]: its last SPREAD_ROUNDS partners' phi distances, per tensor, the largest."""
    drawn, draw = [], simulator.random_groups

    def spy(n, size, rng):
        drawn.append(draw(n, size, rng))
        return drawn[-1]

    h = swarm.inner_steps
    steps = swarm.rounds * h + 2
    config = SimConfig(method=default_method(swarm.method, inner_steps=h, alpha=0.5),
                       inner=InnerHyper(lr=suggested_lr("debug"), warmup_steps=default_warmup_steps(steps),
                                        total_steps=steps),
                       data=DataSpec(kind="corpus"), replicas=swarm.replicas, stages=2, model_size="debug",
                       steps=steps, seed=seed, eval_every_steps=10**9,
                       outer_latency_steps=h // 2 if swarm.late else None, outer_landing="delta-first")
    simulator.random_groups = spy
    try:
        sim = simulator.Simulator(config)
        states, spread, partners = {}, {}, {}
        for step in range(steps + 1):
            before = [[[t.clone() for t in w.slow.phi] for w in ws] for ws in sim.workers]
            seen = len(drawn)
            if step:
                sim.advance(step)
            for stage, groups in enumerate(drawn[seen:]):
                for a, b in (g for g in groups if len(g) == 2):
                    apart = [float((x - y).norm()) for x, y in zip(before[stage][a], before[stage][b])]
                    for r in (a, b):
                        partners.setdefault((stage, r), []).append(apart)
            if step % h in (0, 2):
                for stage, workers in enumerate(sim.workers):
                    for r, w in enumerate(workers):
                        states.setdefault((stage, r), {})[step] = State(
                            [p.detach().clone() for p in w.stage.parameters()],
                            [t.clone() for t in w.slow.phi],
                            [t.clone() for t in w.slow.momentum], step, h, sim.outer_rounds)
                        recent = partners.get((stage, r), [])[-SPREAD_ROUNDS:]
                        spread.setdefault((stage, r), {})[step] = (
                            torch.tensor([max(c) for c in zip(*recent)]) if recent else None)
        return states, spread, sim
    finally:
        simulator.random_groups = draw


def hostile(states: dict, sim: simulator.Simulator, stage: int, step: int, replicas: int) -> dict[str, State]:
    honest = states[(stage, 0)][step]
    h, now = honest.inner_steps, honest.outer_round
    thetas = [states[(stage, r)][step].theta for r in range(replicas)]
    rms = float(torch.cat([torch.stack(g).std(dim=0, unbiased=False).flatten() for g in zip(*thetas)])
                .pow(2).mean().sqrt())
    noise_gen = torch.Generator().manual_seed(step)
    noise = [10 * rms * torch.randn(t.shape, generator=noise_gen) for t in honest.phi]
    biggest = max(range(len(honest.phi)), key=lambda k: honest.phi[k].numel())
    fresh = [p.detach() for p in build_stage(sim.model_config, num_stages=2, stage_index=stage,
                                             seed=12345).parameters()]
    other = [p.detach().clone() for p in build_stage(sim.model_config, num_stages=2, stage_index=stage,
                                                     seed=777).parameters()]

    def replaced(ts):
        return [f.clone() if k == biggest else t for k, (t, f) in enumerate(zip(ts, fresh))]

    old = states[(stage, 0)][step - OLD_ROUNDS * h]
    cases = {
        "scaled by 1.5": State([1.5 * t for t in honest.theta], [1.5 * t for t in honest.phi],
                               honest.momentum,
                               step, h, now),
        "one tensor replaced": State(replaced(honest.theta), replaced(honest.phi), honest.momentum, step, h,
                                     now),
        f"{OLD_ROUNDS} rounds old": State(old.theta, old.phi, old.momentum, step, h, now),
        "another run's": State(other, other, [torch.zeros_like(t) for t in other], step, h, now),
    }
    if rms > 0:  # replicas that always average into one point have no spread to scale noise by
        cases["noise at 10x the spread"] = State([t + e for t, e in zip(honest.theta, noise)],
                                                 [t + e for t, e in zip(honest.phi, noise)], honest.momentum,
                                                 step, h, now)
    return cases


def measure_swarm(swarm: Swarm, result: Result, rng: random.Random) -> None:
    started = time.monotonic()
    states, spread, sim = trained(swarm)
    h = swarm.inner_steps
    counts: dict[str, list[int]] = {}  # case -> [refused, checked]

    def tally(case: str, refused: bool) -> None:
        counts.setdefault(case, [0, 0])
        counts[case][0] += refused
        counts[case][1] += 1

    worst_honest = 0.0
    for stage, step in itertools.product((0, 1), range(h, swarm.rounds * h + 1, h)):
        seed = rng.randrange(1 << 62)
        witnesses = {r: Witness(states[(stage, r)][step].sketch(seed), spread[(stage, r)][step])
                     for r in range(swarm.replicas)}
        for donor in range(swarm.replicas):
            said = {f"w{r}": w for r, w in witnesses.items() if r != donor}
            for donor_step in (step, step - h, step + 2):
                if donor_step not in states[(stage, donor)]:
                    continue
                verdict = check_state(states[(stage, donor)][donor_step].sketch(seed), said, inner_steps=h)
                tally("honest", not verdict.accepted)
                worst_honest = max(worst_honest, verdict.distance_ratio)
        if step < OLD_ROUNDS * h:
            continue
        said = {f"w{r}": w for r, w in witnesses.items() if r != 0}
        for case, state in hostile(states, sim, stage, step, swarm.replicas).items():
            candidate = state.sketch(seed)
            tally(case, not check_state(candidate, said, inner_steps=h).accepted)
            if swarm.replicas >= 3:  # one more identity of the attacker, among two or more honest witnesses
                colluding = check_state(candidate, {**said, "liar": Witness(candidate, None)}, inner_steps=h)
                tally("with a colluding witness", not colluding.accepted)
    for case, (refused, checked) in counts.items():
        result.add(swarm=swarm.label, replicas=swarm.replicas, inner_steps=h, method=swarm.method,
                   late=swarm.late,
                   case=case, checked=checked, refused=refused, refused_share=refused / checked)
    result.summary.setdefault("worst_honest_distance_ratio", {})[swarm.label] = round(worst_honest, 3)
    result.summary.setdefault("swarm_s", {})[swarm.label] = round(time.monotonic() - started, 1)


def sketch_cost() -> dict:
    """Seconds to sketch a `small` stage's state (theta, phi, momentum) on one CPU thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = model_config("small", vocab_size=256, max_seq_len=512)
        params = [p.detach() for p in build_stage(config, num_stages=2, stage_index=1, seed=0).parameters()]
        numel = sum(p.numel() for p in params)
        started = time.perf_counter()
        sketch_state(params, params, params, inner_step=1, outer_round=0, round_steps=1, seed=5)
        seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    return {"parameters": numel, "state_bytes": 12 * numel, "seconds": round(seconds, 3),
            "state_mb_per_s": round(12 * numel / 1e6 / seconds, 1)}


def run(mode: str, out_dir: Path) -> Result:
    result = Result(NAME, mode, out_dir)
    rng = random.Random(33)
    for swarm in SWARMS[mode]:
        measure_swarm(swarm, result, rng)
    result.summary["sketch_cost_small_stage"] = sketch_cost()
    result.note("Each honest check asks every other replica of the stage, as a joiner asks every live peer "
                "(up to 8); the donor's own state counts as one vote for it (state/check.py).")
    result.note(
        "'with a colluding witness': the hostile donor's state again, with its own sketch added as one more "
        "witness; with two honest witnesses that is a 2-against-2 tie, which stands (the limit "
        "docs/ALGORITHM.md section 8 states)."
    )
    return result


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)
    run_mode(__doc__.split("\n\n")[0], run, plot, argv)
    return 0

"""What bench.home_link runs: its plans (quick, full), the scenarios on one stage and on
two, and the run spec every volunteer of a scenario shares."""

from __future__ import annotations

from dataclasses import dataclass

from swarm_node.data.spec import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec

RATIO = 5.0  # the blocking 16-bit round this many times the H inner steps (at least 4, with room for the
# machine: under load the inner steps take longer than when measured alone)
SLOW_RATE_MBIT = 2.0
DATA = "synthetic:alphabet=16,order=2"
HIVEMIND_TIME_FACTOR = 2.5


@dataclass(frozen=True)
class Plan:
    volunteers: int
    rounds: int
    model: str = "tiny"
    inner_steps: int = 50
    staged_steps: int = 100  # stage 0's steps in the 2 x 2 scenarios
    seq_len: int = 64
    batch_size: int = 8
    lr: float = 3e-3


QUICK = Plan(volunteers=2, rounds=4, staged_steps=50)
FULL = Plan(volunteers=4, rounds=8, staged_steps=100)


@dataclass(frozen=True)
class Scenario:
    name: str
    codec: str = "fp16"
    blocking: bool = False  # --blocking-rounds --one-payload-at-a-time: the round before issue 16
    hivemind: bool = False
    rate_mbit: float | None = None  # None: the benchmark's chosen link rate
    method: str = "noloco"
    volunteers: int | None = None  # None: the plan's


METHOD_VOLUNTEERS = 4  # the methods' rounds side by side: DiLoCo's gathers 3 payloads a round, NoLoCo's 1


def method_scenario(method: str) -> str:
    name = "DiLoCo" if method == "diloco" else "NoLoCo"
    return f"{name}, overlapped + compressed, {METHOD_VOLUNTEERS} volunteers"


def scenarios(full: bool) -> list[Scenario]:
    compressed = RunSpec().outer_codec
    return [Scenario("blocking fp16", blocking=True), *([Scenario("overlapped fp16")] if full else []),
            Scenario("overlapped + compressed", compressed), Scenario("hivemind.Optimizer", hivemind=True),
            Scenario(f"overlapped + compressed at {SLOW_RATE_MBIT:g} Mbit/s", compressed,
                     rate_mbit=SLOW_RATE_MBIT),
            *(Scenario(method_scenario(m), compressed, method=m, volunteers=METHOD_VOLUNTEERS)
              for m in ("noloco", "diloco"))]


@dataclass(frozen=True)
class StagedScenario:
    activation_codec: str
    rate_factor: float  # times the 1-stage scenarios' rate


def staged_scenarios(full: bool) -> list[StagedScenario]:
    return [StagedScenario(codec, factor) for factor in ((1.0, 4.0, 16.0) if full else (1.0,))
            for codec in ("fp16", "int8")]


def run_spec(plan: Plan, codec: str, stages: int = 1, activation_codec: str = "fp16",
             method: str = "noloco") -> RunSpec:
    steps = plan.rounds * plan.inner_steps
    return RunSpec(run_id=f"home-{method}-{codec}-{stages}-{activation_codec}", model_size=plan.model,
                   num_stages=stages, seq_len=plan.seq_len, batch_size=plan.batch_size,
                   samples_per_step=plan.batch_size, total_steps=steps, data=DataSpec.parse(DATA),
                   outer_codec=codec, activation_codec=activation_codec,
                   method=default_method(method, inner_steps=plan.inner_steps),
                   inner=InnerHyper(lr=plan.lr, warmup_steps=plan.inner_steps, total_steps=steps))

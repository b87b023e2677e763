"""Sync cost: the critical path of one NoLoCo outer round (a pair exchange) against one
all-reduce among all N peers of a stage with hivemind's DecentralizedAverager.

    .venv/bin/python -m bench.sync_cost [--full]

Each peer is its own process with its own hivemind DHT and libp2p daemon
(bench/sync_cost/peer.py); this parent schedules rounds by wall-clock time and collects
each peer's ``ready`` and ``end`` times. A stage of P parameters is two fp32 tensors of
P elements (phi and Delta; no model is needed to move them). Methods:

- ``pair``: the node's outer round (see the peer's docstring): phi and Delta in fp16
  framed by ``encode_frame``, a random partner found by the node's
  ``PairingCoordinator``, one ``Transport.request`` carrying ours and bringing the
  partner's back, ``decode_frame``, the node's checks, the mean.
- ``pair_matched``: the same exchange with a random partner and the sending side drawn
  ahead by this parent: the pair pattern without the pairing protocol's refusals.
- ``allreduce``: ``DecentralizedAverager.step`` over the same two tensors with FLOAT16
  compression (the pair's bytes per element) and group size N. Matchmaking starts before
  the round and the all-reduce is triggered when the peer is ready (hivemind.Optimizer
  pre-schedules it so); its time is reported apart (``matchmaking_s``).

Settings: ``loopback`` (all peers on 127.0.0.1), and ``tbf_<R>mbit``: each peer in its own
network namespace on one bridge, its upload and download each limited to R Mbit/s by
``tc tbf`` (needs root; skipped with a note otherwise). Stragglers: the last max(1, N // 4)
peers of the stage join the round ``(slow_factor - 1) * inner_phase_s`` late (a slow
inner phase, emulated by a sleep). A peer's idle time runs from its being ready to its
round being done.

Rows (``bench/results/sync_cost.json``):
- ``table: "message"``: setting, rate_mbit, params, frame_bytes, message_s (median time
  for one payload frame to reach a peer over one stream and be acknowledged: encode,
  transfer, the receiver's decode and the node's checks, a small answer), mbit_per_s.
- ``table: "round"``: setting, rate_mbit, params, peers (N), method, stragglers, delay_s,
  rounds, failed, round_s (median critical path: first peer ready to last peer done),
  mean_idle_s, max_idle_s, idle_by_peer_s (mean idle per rank, ``*`` marks stragglers);
  pair methods: exchange_s (median of one successful payload request and its answer),
  attempts (pairing proposals per peer per round; above 1 means refusals, each one round
  trip of a few bytes), compute_s (mean seconds per
  peer of torch work in the round: cast, encode, decode, checks, means); allreduce:
  matchmaking_s (median time to find the group, off the critical path).

Summary keys (the latency-model benchmark reads the first two):
- ``message_time_s[setting][str(params)]``: seconds per message (as in the rows).
- ``message_bytes[str(params)]``: bytes of one fp16 (phi, Delta) frame.
- ``round_time_s[setting][str(params)][str(N)]``: {"pair", "pair_matched", "allreduce",
  "allreduce_with_matchmaking"} seconds, no stragglers.
- ``allreduce_over_pair`` / ``allreduce_over_matched_pair``, keyed like round_time_s:
  all-reduce round time over the pair's.
- ``straggler_idle_s[setting][str(params)][str(N)]``: {method: mean idle seconds per peer}
  with stragglers.
- ``inner_phase_s``, ``slow_factor``, ``straggler_delay_s``, ``compression``."""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from functools import partial

from bench.common.results import Result, parse_mode
from bench.sync_cost.net import Namespaces, available
from bench.sync_cost.report import markdown, plot
from bench.sync_cost.swarm import Swarm
from swarm_node.node_config import NodeConfig

__all__ = ["main", "markdown", "summarize"]

NAME = "sync_cost"
LOOPBACK_BYTES_PER_S = 10e6  # a pessimistic loopback rate (codec and checks included) for time-outs


@dataclass(frozen=True)
class Setting:
    name: str
    rate_mbit: float | None  # None: loopback
    groups: tuple[tuple[int, tuple[int, ...]], ...]  # (stage parameters, the N measured at that size)

    @property
    def num_peers(self) -> int:
        return max(n for _, sizes in self.groups for n in sizes)


@dataclass(frozen=True)
class Plan:
    settings: tuple[Setting, ...]
    plain_rounds: int
    straggler_rounds: int
    message_repeats: int
    inner_phase_s: float = 1.0
    slow_factor: float = 2.0
    compression: str = "fp16"
    matchmaking_s: float = 3.0
    straggler_max_params: int | None = None  # straggler rounds only up to this stage size (None: all)

    @property
    def straggler_delay_s(self) -> float:
        return (self.slow_factor - 1.0) * self.inner_phase_s


M = 1_000_000
# Quick: 3.5 minutes on 2 cores, of which starting 2 x 8 peer processes takes a large part.
QUICK = Plan(settings=(Setting("loopback", None, ((M, (2, 4, 8)), (10 * M, (2,)))),
                       Setting("tbf_200mbit", 200.0, ((M, (2, 4, 8)),))),
             plain_rounds=1, straggler_rounds=1, message_repeats=2, straggler_max_params=M)
_ALL = ((M, (2, 4, 8)), (10 * M, (2, 4, 8)), (50 * M, (2, 4, 8)))
# Full: an hour or more (a pair round that finds no partner waits out the node's 20 s
# deadline plus one exchange: over a minute at 50M parameters and 50 Mbit/s), and up to
# ~16 GB of memory (8 peers holding 50M-parameter stages).
FULL = Plan(settings=(Setting("loopback", None, _ALL), Setting("tbf_200mbit", 200.0, _ALL),
                      Setting("tbf_50mbit", 50.0, _ALL)),
            plain_rounds=3, straggler_rounds=1, message_repeats=5)


# -- pure logic: schedules, time-outs, round statistics ----------------------------------
def expected_message_s(params: int, rate_mbit: float | None) -> float:
    frame_bytes = 2 * params * 2  # phi and Delta in fp16
    return frame_bytes / (LOOPBACK_BYTES_PER_S if rate_mbit is None else rate_mbit * 1e6 / 8)


def round_timeout_s(params: int, rate_mbit: float | None, num_peers: int, delay_s: float) -> float:
    """How long the parent waits for a round's answers: well beyond the slowest honest
    round (an all-reduce moves about 2 payloads per peer); a time-out ends the run."""
    return 60.0 + delay_s + 10.0 * expected_message_s(params, rate_mbit) * max(2, num_peers // 2)


def pair_deadlines_s(params: int, rate_mbit: float | None) -> tuple[float, float]:
    """(seek, request) time-outs of a pair round: the node's defaults (a peer seeks a
    partner for round_timeout_s, then takes the local-only step), stretched so that one
    exchange still fits where the payload is large for the link."""
    exchange_s = 2 * expected_message_s(params, rate_mbit)
    defaults = NodeConfig()
    return defaults.round_timeout_s + exchange_s, max(defaults.exchange_timeout_s, 2 * exchange_s)


def stragglers(members: list[int]) -> list[int]:
    return members[-max(1, len(members) // 4):]


def delays(members: list[int], slow: list[int], delay_s: float) -> dict[int, float]:
    return {r: (delay_s if r in slow else 0.0) for r in members}


def matched_roles(members: list[int], rng: random.Random) -> dict[int, dict]:
    """A random perfect matching of the stage; the first of each pair sends."""
    order = list(members)
    rng.shuffle(order)
    roles = {}
    for a, b in zip(order[::2], order[1::2]):
        roles[a] = {"partner": b, "initiate": True}
        roles[b] = {"partner": a, "initiate": False}
    return roles


def round_stats(answers: dict[int, dict]) -> dict:
    """Critical path (first peer ready to last peer done) and idle times of one round,
    from the peers' wall-clock answers."""
    idle = {rank: a["end"] - a["ready"] for rank, a in answers.items()}
    first_ready = min(a["ready"] for a in answers.values())
    return {"round_s": max(a["end"] for a in answers.values()) - first_ready, "idle": idle}


def median_or_none(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def idle_by_peer(rounds: list[dict]) -> dict[int, float]:
    ranks = sorted(rounds[0]["idle"])
    return {r: statistics.fmean(rnd["idle"][r] for rnd in rounds) for r in ranks}


def idle_text(idle: dict[int, float], slow: list[int]) -> str:
    return " ".join(f"{v:.2f}{'*' if r in slow else ''}" for r, v in idle.items())


def round_row(setting: Setting, params: int, members: list[int], method: str, slow: list[int],
              delay_s: float, outcomes: list[dict]) -> dict:
    """One table row from the outcomes of ``method``'s rounds (failed ones included)."""
    done = [o for o in outcomes if not o["failed"]]
    row = {"table": "round", "setting": setting.name, "rate_mbit": setting.rate_mbit or 0, "params": params,
           "peers": len(members), "method": method, "stragglers": len(slow), "delay_s": delay_s,
           "rounds": len(done), "failed": len(outcomes) - len(done), "round_s": None, "mean_idle_s": None,
           "max_idle_s": None, "idle_by_peer_s": ""}
    if done:
        idle = idle_by_peer(done)
        row.update(round_s=statistics.median(o["round_s"] for o in done),
                   mean_idle_s=statistics.fmean(idle.values()),
                   max_idle_s=max(idle.values()), idle_by_peer_s=idle_text(idle, slow))
    if method == "allreduce":
        row["matchmaking_s"] = median_or_none([o["matchmaking_s"] for o in done])
    else:
        row.update(exchange_s=median_or_none([o["exchange_s"] for o in done]),
                   attempts=statistics.fmean(o["attempts"] for o in outcomes),
                   compute_s=median_or_none([o["compute_s"] for o in done]))
    return row


# -- measurements (need a running swarm) -------------------------------------------------
@dataclass(frozen=True)
class RoundPlan:
    """One round's inputs: who takes part, how late each joins, and the time limits."""
    params: int
    rate_mbit: float | None
    members: list[int]
    waits: dict[int, float]
    timeout_s: float  # how long the parent waits for the answers


class Bench:
    def __init__(self, plan: Plan, result: Result, seed: int = 0):
        self.plan = plan
        self.result = result
        self.rng = random.Random(seed)
        self._round_key = 0
        self._averager_groups = 0

    def measure_message(self, swarm: Swarm, setting: Setting, params: int) -> None:
        timeout = round_timeout_s(params, setting.rate_mbit, 2, 0.0)
        (answer,) = swarm.call([0], "message", timeout_s=timeout * (self.plan.message_repeats + 1), to=1,
                               repeats=self.plan.message_repeats, request_timeout_s=timeout)
        message_s = statistics.median(answer["times_s"])
        self.result.add(table="message", setting=setting.name, rate_mbit=setting.rate_mbit or 0,
                        params=params,
                        frame_bytes=answer["frame_bytes"], message_s=message_s,
                        mbit_per_s=answer["frame_bytes"] * 8 / message_s / 1e6)

    def pair_round(self, swarm: Swarm, rp: RoundPlan, matched: bool) -> dict:
        self._round_key += 1
        roles = matched_roles(rp.members, self.rng) if matched else {r: {} for r in rp.members}
        seek_s, request_s = pair_deadlines_s(rp.params, rp.rate_mbit)
        start_at = time.time() + 0.3  # time for the commands to arrive everywhere
        answers = swarm.call_each({r: dict(round_key=self._round_key, members=rp.members, start_at=start_at,
                                           delay_s=rp.waits[r], request_timeout_s=request_s,
                                           round_timeout_s=seek_s, **roles[r]) for r in rp.members},
                                  "pair_round", timeout_s=rp.timeout_s)
        attempts = statistics.fmean(a.get("attempts", 0) for a in answers.values())
        if not all(a["ok"] and a["partner"] is not None for a in answers.values()):
            errors = {r: a.get("error") or "no partner (local-only step)" for r, a in answers.items()}
            self.result.note(
                f"a {'matched ' if matched else ''}pair round of {len(rp.members)} peers with "
                f"{rp.params / 1e6:g}M parameters failed ({attempts:.1f} proposals per peer): {errors}"
            )
            return {"failed": True, "attempts": attempts}
        return {**round_stats(answers), "failed": False, "attempts": attempts,
                "exchange_s": median_or_none([a["exchange_s"] for a in answers.values()]),
                "compute_s": statistics.fmean(a["compute_s"] for a in answers.values())}

    def allreduce_round(self, swarm: Swarm, rp: RoundPlan) -> dict:
        matched = swarm.call_each({r: dict(timeout_s=rp.timeout_s) for r in rp.members}, "allreduce_prepare",
                                  timeout_s=rp.timeout_s * 2)
        start_at = time.time() + 0.3
        answers = swarm.call_each({r: dict(start_at=start_at, delay_s=rp.waits[r], timeout_s=rp.timeout_s)
                                   for r in rp.members}, "allreduce_go", timeout_s=rp.timeout_s * 2)
        if not all(a["ok"] and a["group_size"] == len(rp.members) for a in answers.values()):
            errors = {r: a.get("error") or f"group of {a.get('group_size')}" for r, a in answers.items()}
            self.result.note(
                f"an all-reduce round of {len(rp.members)} peers with {rp.params / 1e6:g}M parameters "
                f"failed: {errors}"
            )
            return {"failed": True}
        return {**round_stats(answers), "failed": False,
                "matchmaking_s": max(a["matchmaking_s"] for a in matched.values() if a["ok"])}

    def run_method(self, swarm: Swarm, setting: Setting, params: int, members: list[int], method: str,
                   slow: list[int]) -> None:
        delay_s = self.plan.straggler_delay_s if slow else 0.0
        rp = RoundPlan(params, setting.rate_mbit, members, delays(members, slow, delay_s),
                       round_timeout_s(params, setting.rate_mbit, len(members), delay_s))
        one_round = {"pair": partial(self.pair_round, matched=False), "pair_matched": partial(self.pair_round,
                     matched=True), "allreduce": self.allreduce_round}[method]
        num_rounds = self.plan.straggler_rounds if slow else self.plan.plain_rounds
        row = round_row(setting, params, members, method, slow, delay_s,
                        [one_round(swarm, rp) for _ in range(num_rounds)])
        self.result.add(**row)
        print(f"  {setting.name} P={params:,} N={len(members)} {method:12s} stragglers={len(slow)}: "
              f"round {_fmt(row['round_s'])} s, mean idle {_fmt(row['mean_idle_s'])} s", flush=True)

    def run_group(self, swarm: Swarm, setting: Setting, params: int, num_peers: int) -> None:
        members = list(range(num_peers))
        limit = self.plan.straggler_max_params
        variants = [[]] + ([stragglers(members)] if limit is None or params <= limit else [])
        for method in ("pair", "pair_matched"):
            for slow in variants:
                self.run_method(swarm, setting, params, members, method, slow)
        self._averager_groups += 1
        swarm.call(members, "averager_open", timeout_s=120,
                   prefix=f"sba_{setting.name}_{params}_{num_peers}_{self._averager_groups}",
                   group_size=num_peers, compression=self.plan.compression,
                   matchmaking_s=self.plan.matchmaking_s)
        try:
            for slow in variants:
                self.run_method(swarm, setting, params, members, "allreduce", slow)
        finally:
            swarm.call(members, "averager_close", timeout_s=60)

    def run_setting(self, swarm: Swarm, setting: Setting) -> None:
        for params, group_sizes in setting.groups:
            swarm.call(range(swarm.num_peers), "load", timeout_s=120, params=params, seed=params % 9973)
            self.measure_message(swarm, setting, params)
            for num_peers in group_sizes:
                self.run_group(swarm, setting, params, num_peers)


def _fmt(value: float | None) -> str:
    return "failed" if value is None else f"{value:.2f}"


def run_loopback(bench: Bench, settings: list[Setting]) -> None:
    if not settings:
        return
    with Swarm(max(s.num_peers for s in settings)) as swarm:
        for setting in settings:
            bench.run_setting(swarm, setting)


def run_shaped(bench: Bench, settings: list[Setting]) -> None:
    """One swarm in namespaces for every shaped setting: only the tbf rate changes."""
    if not settings:
        return
    why_not = available()
    if why_not:
        bench.result.note(f"shaped settings skipped: {why_not}")
        return
    num_peers = max(s.num_peers for s in settings)
    with Namespaces(num_peers) as namespaces, Swarm(num_peers, namespaces) as swarm:
        for setting in settings:
            namespaces.shape(setting.rate_mbit)
            bench.run_setting(swarm, setting)


NOTES = (
    "Every peer of a setting shares this machine's CPUs: with N = 8 on 2 cores the loopback times include "
    "CPU contention (each peer's libp2p daemon encrypts and copies every byte, each side casts and checks).",
    "The pair round uses the node's PairingCoordinator; the seeking flags travel through a shared file at "
    "once, where the node reads them from registry records refreshed every heartbeat (2 s): the best case "
    "for pairs.",
    "The all-reduce's matchmaking runs before the round (pre-scheduled, as hivemind.Optimizer does it); a "
    "plain DecentralizedAverager.step() would add matchmaking_s to its critical path.",
    "tc netem is missing on these machines: the shaped settings limit bandwidth (tbf, both directions of "
    "every peer's link) but add no latency.",
    "This benchmark found a pairing livelock in the node before commit 'pairing proposals': a request "
    "carried the whole payload, so every refusal cost a full upload, and at 10M parameters and N = 2 two "
    "peers' requests crossed again and again (17 requests per peer, no partner in 20 s; pair rounds took "
    "1.3-4x a matched pair's time). Pairing now starts with a few-byte proposal, and crossed proposals pair "
    "by peer id.",
)



# -- summary -----------------------------------------------------------------------------
def _branch(table: dict, *keys: str) -> dict:
    """``table[k1][k2]...``, creating the dictionaries on the way."""
    for key in keys:
        table = table.setdefault(key, {})
    return table


def summarize(rows: list[dict], plan: Plan) -> dict:
    """The headline numbers, keyed as the module docstring says."""
    summary = {"message_time_s": {}, "message_bytes": {}, "round_time_s": {}, "allreduce_over_pair": {},
               "allreduce_over_matched_pair": {}, "straggler_idle_s": {}, "inner_phase_s": plan.inner_phase_s,
               "slow_factor": plan.slow_factor, "straggler_delay_s": plan.straggler_delay_s,
               "compression": plan.compression}
    for row in rows:
        if row["table"] == "message":
            _branch(summary["message_time_s"], row["setting"])[str(row["params"])] = row["message_s"]
            summary["message_bytes"][str(row["params"])] = row["frame_bytes"]
    rounds = {(r["setting"], r["params"], r["peers"], r["method"], r["stragglers"] > 0): r
              for r in rows if r["table"] == "round"}
    for (setting, params, peers, method, slowed), row in rounds.items():
        key = (setting, str(params), str(peers))
        if slowed:
            _branch(summary["straggler_idle_s"], *key)[method] = row["mean_idle_s"]
            continue
        times = _branch(summary["round_time_s"], *key)
        times[method] = row["round_s"]
        if method == "allreduce" and row["round_s"] is not None and row.get("matchmaking_s") is not None:
            times["allreduce_with_matchmaking"] = row["round_s"] + row["matchmaking_s"]
    for setting, by_size in summary["round_time_s"].items():
        for params, by_n in by_size.items():
            for peers, times in by_n.items():
                for key, pair in (("allreduce_over_pair", "pair"), ("allreduce_over_matched_pair",
                                                                    "pair_matched")):
                    if times.get(pair) and times.get("allreduce"):
                        _branch(summary[key], setting, params)[peers] = times["allreduce"] / times[pair]
    return summary


def main(argv: list[str] | None = None) -> None:
    args = parse_mode(__doc__.split("\n\n")[0], argv)
    plan = FULL if args.full else QUICK
    result = Result(NAME, args.mode, args.out_dir)
    bench = Bench(plan, result)
    run_loopback(bench, [s for s in plan.settings if s.rate_mbit is None])
    run_shaped(bench, [s for s in plan.settings if s.rate_mbit is not None])
    result.summary = summarize(result.rows, plan)
    result.notes[:0] = NOTES
    if plan.plain_rounds == 1:
        result.note(
            "One round per point (quick mode): single rounds on a shared 2-core machine are noisy, the "
            "node's pairing most (its refusals and back-offs are random). Read the direction of the ratios, "
            "not their second digit; --full takes medians over several rounds."
        )
    path = result.write()
    plot(json.loads(path.read_text()), result.path(".png"))

"""A swarm-scale run: the population (links, speeds, who sits behind a NAT), churn, and
the figures of every round, forward and byte, over a measuring window after warm-up."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
from dataclasses import asdict, dataclass

from swarm_node.node_config import NodeConfig
from swarm_node.optim.methods import default_method
from swarm_node.scale.config import ScaleConfig
from swarm_node.scale.network import DhtCosts, Endpoint, Network
from swarm_node.scale.peer import RoundRecord, SimPeer
from swarm_node.spec import RunSpec

MODEL_FOR_STAGES = "small"  # 12 layers: up to 12 stages; no model is built
WARM_UP_ROUNDS = 2  # rounds before the measuring window: records spread, peers verify each other


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high))) if low > 0 else rng.uniform(low, high)


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class ScaleFigures:
    peers_per_stage: int
    method: str
    window_s: float
    rounds: int  # rounds of live peers ended in the window
    partner_share: float  # of those, with a partner (DiLoCo: with at least one other contribution)
    alone_rounds: int  # rounds in which a peer saw nobody else in its stage
    proposals_per_round: float
    refusals_per_round: float
    to_partner_median_s: float | None
    to_partner_p99_s: float | None
    to_partner_median_rtts: float | None  # in round trips of the pair
    round_median_s: float | None  # boundary to outer step applied
    idle_per_round_s: float  # inner steps stood still for the round (the gate held)
    control_bytes_per_peer_min_median: float
    control_bytes_per_peer_min_p99: float
    control_bytes_per_peer_min_max: float
    control_by_kind_per_peer_min: dict
    registry_ops_per_peer_min: dict  # DHT gets, entries they returned, stores: mean of live peers
    forwards: int
    forwards_to_dead_share: float
    forwards_to_unreachable_share: float
    forwards_lost_share: float
    crashes: int
    leaves: int
    joins: int
    real_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class World:
    def __init__(self, config: ScaleConfig, node_config: NodeConfig | None = None,
                 costs: DhtCosts | None = None):
        self.config = config
        self.node_config = node_config or NodeConfig()
        self.rng = random.Random(config.seed)
        self.spec = RunSpec(run_id="scale", model_size=MODEL_FOR_STAGES, num_stages=config.stages,
                            method=default_method(config.method, inner_steps=config.inner_steps),
                            registry_shards=config.registry_shards)
        self.network = Network(self.rng, costs or DhtCosts(), config.record_delay_s, self._modelled_bytes,
                               op_s={"get": config.dht_get_s, "store": config.dht_store_s})
        self.peers: dict[str, SimPeer] = {}
        self.rounds: list[RoundRecord] = []
        self.crashes = self.leaves = self.joins = 0
        self._next_id = 0

    def _modelled_bytes(self, protocol: str, is_request: bool, actual: int) -> int:
        """What crosses the link: the outer payload and activations at their real size
        (the simulated ones carry a few dozen weights)."""
        from swarm_node.net import protocols

        if (protocol == protocols.OUTER and is_request) or (
            protocol == protocols.OUTER_FETCH and not is_request
        ):
            return self.config.payload_bytes
        if protocol == protocols.FORWARD and is_request:
            return self.config.activation_bytes
        return actual

    # -- the population -------------------------------------------------------------
    def _new_peer(self, stage: int, reachable: bool) -> SimPeer:
        c = self.config
        self._next_id += 1
        peer_id = f"SimPeer{self._next_id:05d}{self.rng.getrandbits(64):016x}"
        uplink = _log_uniform(self.rng, *c.uplink_mbit_s) * 1e6
        endpoint = Endpoint(peer_id, rtt_s=_log_uniform(self.rng, *c.rtt_ms) / 1e3, uplink_bps=uplink,
                            downlink_bps=uplink * c.downlink_factor, reachable=reachable)
        self.network.add(endpoint)
        speed = self.rng.lognormvariate(0.0, c.speed_sigma) * (c.straggler_factor if self.rng.random() <
                                                                c.straggler_share else 1.0)
        peer = SimPeer(spec=self.spec, config=self.node_config, network=self.network, endpoint=endpoint,
                       stage=stage,
                       step_s=c.step_s * speed, step_jitter_sigma=c.step_jitter_sigma,
                       payload_bytes=c.payload_bytes,
                       rng=random.Random(self.rng.random()), on_round=self.rounds.append,
                       round_work_s={"prepare": c.round_prepare_s, "check": c.round_check_s,
                                     "close": c.round_close_s})
        self.peers[peer_id] = peer
        return peer

    def live(self, stage: int | None = None) -> list[SimPeer]:
        return [p for p in self.peers.values() if p.endpoint.alive and (stage is None or p.stage == stage)]

    async def _start_population(self) -> None:
        c = self.config
        unreachable = round(c.unreachable_share * c.total_peers)  # all in stage 0, as real nodes choose
        starting = []
        for stage in range(c.stages):
            for i in range(c.peers_per_stage):
                starting.append(self._new_peer(stage, reachable=not (stage == 0 and i < unreachable)))

        async def start(peer: SimPeer) -> None:
            await asyncio.sleep(self.rng.uniform(0.0, 5.0))
            await peer.start(donor=None)

        await asyncio.gather(*(start(p) for p in starting))

    async def _churn(self) -> None:
        """Crashes, leaves and joins as Poisson processes over the live population."""
        c = self.config
        per_peer_s = (c.crash_per_hour + c.leave_per_hour) / 3600.0
        joins_s = c.joins_per_stage_hour_effective * c.stages / 3600.0
        while True:
            live = self.live()
            rate = per_peer_s * len(live) + joins_s
            if rate <= 0:
                return
            await asyncio.sleep(self.rng.expovariate(rate))
            pick = self.rng.random() * rate
            if pick < c.crash_per_hour / 3600.0 * len(live):
                self.rng.choice(live).crash()
                self.crashes += 1
            elif pick < per_peer_s * len(live):
                asyncio.create_task(self.rng.choice(live).leave())
                self.leaves += 1
            else:
                await self._join()

    async def _join(self) -> None:
        c = self.config
        stage = min(range(c.stages), key=lambda s: (len(self.live(s)), s))
        reachable = not (stage == 0 and self.rng.random() < c.unreachable_share * c.stages)
        donors = self.live(stage)
        peer = self._new_peer(stage, reachable)
        self.joins += 1
        asyncio.create_task(peer.start(donor=self.rng.choice(donors) if donors else None))

    # -- the run --------------------------------------------------------------------
    async def run(self) -> ScaleFigures:
        c = self.config
        random.seed(c.seed)  # Membership draws from the module's generator (jittered loops, probes)
        loop = asyncio.get_running_loop()
        await self._start_population()
        churn = asyncio.create_task(self._churn())
        warm_up_s = min(c.duration_s / 3, WARM_UP_ROUNDS * c.inner_steps * c.step_s)
        await asyncio.sleep(warm_up_s)
        window_start = loop.time()
        before = self._snapshot()
        await asyncio.sleep(c.duration_s - warm_up_s)
        after = self._snapshot()
        churn.cancel()
        for peer in self.peers.values():
            for task in peer.tasks:
                task.cancel()
        await asyncio.gather(churn, *(t for p in self.peers.values() for t in p.tasks),
                             return_exceptions=True)
        return self._figures(window_start, loop.time(), before, after)

    def _snapshot(self) -> dict:
        return {p.peer_id: {"traffic": dict(p.endpoint.traffic.bytes_by_kind),
                            "refusals": p.counters.refusals,
                            "held_s": p.gate.held_s, "forwards": asdict(p.counters.forwards),
                            "dht": asdict(p.dht.ops)}
                for p in self.peers.values()}

    def _figures(self, start: float, end: float, before: dict, after: dict) -> ScaleFigures:
        c = self.config
        window = [
            r for r in self.rounds if start <= r.ended_at <= end and self.network.endpoints[r.peer].alive
        ]
        with_partner = [r for r in window if r.partners > 0]
        to_partner = [r.to_partner_s for r in with_partner if r.to_partner_s is not None]
        in_rtts = []
        for r in with_partner:
            if r.to_partner_s is not None and r.partner in self.network.endpoints:
                rtt = (self.network.endpoints[r.peer].rtt_s + self.network.endpoints[r.partner].rtt_s) / 2
                in_rtts.append(r.to_partner_s / rtt)
        n_rounds = max(1, len(window))
        span_min = (end - start) / 60.0
        per_peer_min, by_kind, registry_ops = [], {}, {}
        live_ids = [p for p in after if self.network.endpoints[p].alive and p in before]
        for peer in live_ids:
            delta = {k: v - before[peer]["traffic"].get(k, 0) for k, v in after[peer]["traffic"].items()}
            per_peer_min.append(sum(delta.values()) / span_min)
            for k, v in delta.items():
                by_kind.setdefault(k, []).append(v / span_min)
            for k, v in after[peer]["dht"].items():
                registry_ops.setdefault(k, []).append((v - before[peer]["dht"][k]) / span_min)
        refusals = sum(after[p]["refusals"] - before.get(p, {"refusals": 0})["refusals"] for p in after)
        held = sum(after[p]["held_s"] - before.get(p, {"held_s": 0.0})["held_s"] for p in after)
        fwd = {k: sum(after[p]["forwards"][k] - before.get(p, {"forwards": {k: 0}})["forwards"].get(k, 0)
                      for p in after) for k in ("sent", "to_dead", "to_unreachable", "failed", "lost")}
        sent = max(1, fwd["sent"])
        all_rounds = [r for r in self.rounds if start <= r.ended_at <= end]
        return ScaleFigures(
            peers_per_stage=c.peers_per_stage, method=c.method, window_s=end - start, rounds=len(window),
            partner_share=len(with_partner) / n_rounds, alone_rounds=sum(r.alone for r in window),
            proposals_per_round=sum(r.proposals for r in window) / n_rounds,
            refusals_per_round=refusals / max(1, len(all_rounds)),
            to_partner_median_s=statistics.median(to_partner) if to_partner else None,
            to_partner_p99_s=_quantile(to_partner, 0.99),
            to_partner_median_rtts=statistics.median(in_rtts) if in_rtts else None,
            round_median_s=statistics.median([r.ended_at - r.started_at for r in window]) if window else None,
            idle_per_round_s=held / max(1, len(all_rounds)),
            control_bytes_per_peer_min_median=statistics.median(per_peer_min) if per_peer_min else 0.0,
            control_bytes_per_peer_min_p99=_quantile(per_peer_min, 0.99) or 0.0,
            control_bytes_per_peer_min_max=max(per_peer_min, default=0.0),
            control_by_kind_per_peer_min={k: statistics.mean(v) for k, v in sorted(by_kind.items())},
            registry_ops_per_peer_min={k: statistics.mean(v) for k, v in registry_ops.items()},
            forwards=fwd["sent"], forwards_to_dead_share=fwd["to_dead"] / sent,
            forwards_to_unreachable_share=fwd["to_unreachable"] / sent,
            forwards_lost_share=fwd["lost"] / sent,
            crashes=self.crashes, leaves=self.leaves, joins=self.joins)

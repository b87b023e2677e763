"""Membership through its seams: joiners that start together pick their stages through a
shared (fake) registry on the virtual clock and spread evenly; a leaving record takes a
peer out of everyone's view at once."""

import asyncio
import time

import vclock
from parts import signed_entries

from swarm_node import __version__
from swarm_node.membership.reachability import Reachability
from swarm_node.membership.view import Membership
from swarm_node.net.guard import PeerGuard
from swarm_node.node_config import NodeConfig
from swarm_node.spec import RunSpec
from swarm_node.wire.records import PeerRecord

SPEC = RunSpec(run_id="m", model_size="tiny", num_stages=2)


class SharedRegistry:
    """One DHT's signed entries as every joiner sees them: key -> peer -> value."""

    def __init__(self):
        self.entries: dict[str, dict[str, dict]] = {}

    def for_peer(self, peer_id: str):
        registry = self

        class PeerDHT:
            def __init__(self):
                self.peer_id = peer_id

            def is_alive(self):
                return True

            def wall_now(self):
                return time.time()

            async def get_signed(self, key, sufficient_expiry_s=None):
                return signed_entries(registry.entries.get(key, {}))

            async def store_signed(self, key, value, ttl_s):
                for entries in registry.entries.values():  # a record moves when its stage changes
                    entries.pop(peer_id, None)
                registry.entries.setdefault(key, {})[peer_id] = value
                return True

        return PeerDHT()


def joiner(registry: SharedRegistry, peer_id: str, reachable: bool = True) -> Membership:
    view = None

    def record():
        return PeerRecord(stage=view.stage, spec_hash=SPEC.spec_hash(), version=__version__, state=view.state,
                          reachable=view.reachable)

    view = Membership(spec=SPEC, dht=registry.for_peer(peer_id), guard=PeerGuard(), config=NodeConfig(),
                      record=record)
    view.reachability = Reachability(reachable)
    return view


async def join_together(views: list[Membership], stagger_s: float) -> list[int]:
    async def join(i, view):
        await asyncio.sleep(i * stagger_s)
        await view.refresh(all_stages=True)
        stage = await view.pick_stage()
        view.state = "training"
        await view.heartbeat()
        return stage

    return await asyncio.gather(*(join(i, v) for i, v in enumerate(views)))


def test_four_joiners_started_together_split_two_and_two():
    for stagger_s in (0.0, 0.3, 1.0):
        registry = SharedRegistry()
        views = [joiner(registry, f"Qm{c}") for c in "dacb"]
        stages = vclock.run(join_together(views, stagger_s))
        assert sorted(stages) == [0, 0, 1, 1], (stagger_s, stages)


def test_a_joiner_behind_a_nat_takes_stage_0_and_the_others_balance_around_it():
    registry = SharedRegistry()
    views = [joiner(registry, "QmNat", reachable=False), joiner(registry, "QmA"), joiner(registry, "QmB")]
    stages = vclock.run(join_together(views, 0.0))
    assert stages[0] == 0 and sorted(stages) == [0, 0, 1]


def test_a_leaving_record_takes_the_peer_out_of_the_view_at_once():
    registry = SharedRegistry()
    a, b = joiner(registry, "QmA"), joiner(registry, "QmB")

    async def scenario():
        a.stage, b.stage = 1, 0
        a.state = "training"
        await a.heartbeat()
        await b.refresh()
        seen = set(b.next_stage_peers())
        a.state = "leaving"
        await a.heartbeat()
        await b.refresh()
        return seen, set(b.next_stage_peers())

    before, after = vclock.run(scenario())
    assert before == {"QmA"} and after == set()


def test_a_later_stage_sees_the_stage_before_ended_only_after_a_record_lifetime_without_it():
    """A DHT read can come back without a stage's records while they live; one such read
    ended a stage-1 node given --max-steps in the middle of the run."""
    registry = SharedRegistry()
    upstream, view = joiner(registry, "QmUp"), joiner(registry, "QmDown")

    async def scenario():
        upstream.stage, upstream.state = 0, "training"
        await upstream.heartbeat()
        answers = [await view.stage_has_ended(0)]
        live = registry.entries.copy()
        registry.entries.clear()  # a lookup that found nothing, while stage 0 trains on
        answers.append(await view.stage_has_ended(0))
        await asyncio.sleep(view.config.record_ttl_s / 2)
        answers.append(await view.stage_has_ended(0))
        registry.entries.update(live)
        answers.append(await view.stage_has_ended(0))
        upstream.state = "finished"
        await upstream.heartbeat()
        answers.append(await view.stage_has_ended(0))
        await asyncio.sleep(view.config.record_ttl_s)
        answers.append(await view.stage_has_ended(0))
        return answers

    assert vclock.run(scenario()) == [False, False, False, False, False, True]

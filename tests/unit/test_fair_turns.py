"""Peers' requests share a stage's compute in turn (train/compute.py FairTurns): a caller
with many micro-batches in flight does not crowd out one with few."""

from __future__ import annotations

import asyncio

from swarm_node.train.compute import FairTurns


async def _serve(turns: FairTurns, requests: list[str]) -> list[str]:
    """Every request asks for its turn at once; each turn is one step of the loop."""
    order, inside = [], [0]
    most = [0]

    async def one(caller: str):
        async with turns.turn(caller):
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            order.append(caller)
            await asyncio.sleep(0)
            inside[0] -= 1

    await asyncio.gather(*(one(caller) for caller in requests))
    return order, most[0]


def test_callers_are_served_in_turn_not_in_arrival_order():
    turns = FairTurns(out=1)
    order, most = asyncio.run(_serve(turns, ["a"] * 6 + ["b"] * 2 + ["c"]))
    assert most == 1
    assert order == ["a", "a", "b", "c", "a", "b", "a", "a", "a"]  # the first went straight in


def test_two_turns_out_at_once_keep_the_thread_fed():
    order, most = asyncio.run(_serve(FairTurns(out=2), ["a"] * 4 + ["b"] * 2))
    assert most == 2 and sorted(order) == ["a"] * 4 + ["b"] * 2
    assert order.index("b") <= 3  # b does not wait behind all of a's


def test_a_cancelled_waiter_leaves_its_place_and_the_turn_passes_on():
    async def run():
        turns = FairTurns(out=1)
        release = asyncio.Event()
        served = []

        async def hold():
            async with turns.turn("a"):
                await release.wait()

        async def wait(caller):
            async with turns.turn(caller):
                served.append(caller)

        holder = asyncio.create_task(hold())
        await asyncio.sleep(0)
        doomed = asyncio.create_task(wait("b"))
        later = asyncio.create_task(wait("c"))
        await asyncio.sleep(0)
        doomed.cancel()
        release.set()
        await asyncio.wait_for(asyncio.gather(holder, later), 5)
        assert doomed.cancelled() and served == ["c"]
        async with turns.turn("d"):  # nothing left counted out
            pass
        assert turns._out == 0

    asyncio.run(run())

"""The gate between inner steps and outer rounds (train/rounds.py): a blocking round holds
the steps until it is over; an overlapped one lets them go on once its payload is taken,
unless the next boundary comes first; a node finishing waits for the round either way."""

import asyncio

import vclock

from swarm_node.train.rounds import RoundGate


def test_an_overlapped_round_reopens_the_steps_and_a_boundary_during_it_holds_them_again():
    async def scenario():
        gate = RoundGate()
        gate.note_due(True)
        assert not gate.idle.is_set() and gate.in_round
        await gate.next_round()
        gate.resume_steps()  # the payload is taken
        assert gate.idle.is_set() and gate.in_round and not gate.settled.is_set()
        gate.note_due(True)  # the next boundary, while the exchange still runs
        assert not gate.idle.is_set()
        gate.round_over()
        assert not gate.idle.is_set() and gate.in_round  # shut for the round that is due now
        await asyncio.wait_for(gate.next_round(), 1)
        gate.round_over()
        assert gate.idle.is_set() and gate.settled.is_set() and not gate.in_round

    asyncio.run(scenario())


def test_the_gate_counts_the_time_it_held_the_steps():
    async def scenario():  # on the virtual clock: the held time is exact, whatever the machine's load
        gate = RoundGate()
        gate.note_due(True)
        await asyncio.sleep(0.05)
        gate.resume_steps()
        assert gate.held_s == 0.05
        await asyncio.sleep(0.05)  # steps run while the exchange does: not counted
        gate.round_over()
        assert gate.held_s == 0.05

    vclock.run(scenario())


def test_the_gate_tells_when_the_steps_last_stood_still():
    """At a round's start: its boundary, where the last round's steps ended."""
    async def scenario():
        gate = RoundGate()
        assert gate.shut_at is None
        gate.note_due(True)
        await gate.next_round()
        gate.resume_steps()
        await asyncio.sleep(1.0)
        assert gate.shut_at == 0
        gate.note_due(True)  # the next boundary, the exchange still running
        gate.round_over()
        await gate.next_round()
        assert gate.shut_at == 1.0

    vclock.run(scenario())


def test_the_gate_tells_its_held_time_with_the_hold_under_way():
    async def scenario():
        gate = RoundGate()
        gate.note_due(True)
        await asyncio.sleep(0.5)
        assert gate.held_s == 0 and gate.held_now_s() == 0.5
        gate.resume_steps()
        await asyncio.sleep(1.0)
        assert gate.held_s == gate.held_now_s() == 0.5

    vclock.run(scenario())

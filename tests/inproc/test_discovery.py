"""Publishing and finding the run spec over real DHTs in this process; the client-mode
fallback; re-bootstrapping when every connection is gone."""

import asyncio
import dataclasses
import json
import logging
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import vclock

from swarm_node.errors import ConfigError, IncompatibleRun, SwarmError
from swarm_node.membership.reconnect import Backoff, Reconnector
from swarm_node.net import dht as dht_module
from swarm_node.net.dht import SwarmDHT
from swarm_node.spec import RunSpec
from swarm_node.spec_record import find_run_spec, publish_spec, spec_key

SPEC = RunSpec(run_id="alpha")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _swarm(n: int) -> list[SwarmDHT]:
    first = await SwarmDHT.start()
    rest = [await SwarmDHT.start(initial_peers=first.visible_maddrs()) for _ in range(n - 1)]
    return [first, *rest]


async def _close(*dhts: SwarmDHT) -> None:
    for d in dhts:
        await d.shutdown()


def test_joiner_reads_the_spec_its_initial_peer_signed_and_ignores_forgeries():
    async def scenario():
        boot, forger, joiner = await _swarm(3)
        try:
            assert await publish_spec(boot, SPEC)
            # The forger signs its own entry under the bootstrap's key: valid in the DHT, not trusted.
            forged = dataclasses.replace(SPEC, seq_len=32)
            await forger.store_signed(spec_key(boot.peer_id),
                                      {"run_id": "alpha", "spec": forged.canonical_json(),
                                       "spec_hash": forged.spec_hash(), "min_version": "0.1.0"}, ttl_s=60)
            # ...and cannot overwrite the bootstrap's own entry.
            assert not await forger.store(spec_key(boot.peer_id), boot._owner, {"run_id": "evil"}, ttl_s=60)
            assert set(await joiner.get_signed(spec_key(boot.peer_id))) == {boot.peer_id, forger.peer_id}
            return await find_run_spec(joiner, [boot.visible_maddrs()[0]])
        finally:
            await _close(boot, forger, joiner)

    spec, publisher = run(scenario())
    assert spec == SPEC and publisher is not None


def test_mismatches_are_refused_with_what_to_do():
    async def scenario():
        a, b, joiner = await _swarm(3)
        try:
            other = dataclasses.replace(SPEC, run_id="beta")
            await publish_spec(a, SPEC)
            await publish_spec(b, other)
            peers = [a.visible_maddrs()[0], b.visible_maddrs()[0]]
            with pytest.raises(ConfigError, match="publish different runs.*--run-id"):
                await find_run_spec(joiner, peers)
            chosen, _ = await find_run_spec(joiner, peers, run_id="beta")
            assert chosen == other
            with pytest.raises(IncompatibleRun, match="your run spec file has hash"):
                await find_run_spec(joiner, peers[:1], local_spec=dataclasses.replace(SPEC, seed=5))
            # a plain DHT peer publishes nothing: with a spec at hand that is fine, without one it is an error
            assert (await find_run_spec(a, [joiner.visible_maddrs()[0]], local_spec=SPEC))[0] == SPEC
            with pytest.raises(SwarmError, match="none of the initial peers publishes a run spec"):
                await find_run_spec(a, [joiner.visible_maddrs()[0]], timeout_s=1.0)
        finally:
            await _close(a, b, joiner)

    run(scenario())


def test_unreachable_node_falls_back_to_client_mode_with_relays(monkeypatch, caplog):
    calls = []

    class FakeDHT:
        peer_id = "QmFake"

        def __init__(self, **kwargs):
            calls.append(kwargs)
            if not kwargs["client_mode"]:
                raise RuntimeError(
                    "Peer QmBoot can't access this node. Probably, libp2p has failed to bypass the firewall"
                )

    monkeypatch.setattr(dht_module, "DHT", FakeDHT)
    with caplog.at_level(logging.WARNING):
        started = run(SwarmDHT.start(initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/QmBoot"]))
    assert started.client_mode and len(calls) == 2
    assert calls[1]["client_mode"] and calls[1]["use_relay"] and calls[1]["use_auto_relay"]
    assert any("client mode through relays" in r.getMessage() for r in caplog.records)
    shutil.rmtree(started._throwaway_dir)  # the identity it made; FakeDHT has no shutdown


def test_rebootstrap_reconnects_to_a_restarted_peer(tmp_path):
    async def scenario():
        identity = str(tmp_path / "boot.key")
        host = [f"/ip4/127.0.0.1/tcp/{free_port()}"]
        boot = await SwarmDHT.start(host_maddrs=host, identity_path=identity)
        maddr = boot.visible_maddrs()[0]
        node = await SwarmDHT.start(initial_peers=[maddr])
        try:
            await boot.shutdown()
            boot = await SwarmDHT.start(host_maddrs=host, identity_path=identity)
            assert boot.visible_maddrs()[0] == maddr  # same identity and port: same address
            assert await publish_spec(boot, SPEC)
            assert await node.rebootstrap([maddr]) == 1
            return await find_run_spec(node, [maddr], timeout_s=10)
        finally:
            await _close(boot, node)

    spec, _ = run(scenario())
    assert spec == SPEC


class ScriptedDHT:
    """Answers connected_peers from a script (the last answer repeats) and records each dial."""

    peer_id = "QmSelf"

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls = []
        self.redialled = asyncio.Event()

    async def connected_peers(self):
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    async def rebootstrap(self, maddrs, timeout_s=10.0):
        self.calls.append(list(maddrs))
        self.redialled.set()
        return 1


def first_dial(dht: ScriptedDHT) -> list[str]:
    """What the reconnector dials first (the scenario ends there)."""
    reconnector = Reconnector(dht, ("/ip4/127.0.0.1/tcp/9/p2p/QmBoot",), check_s=0.01)

    async def scenario():
        task = asyncio.create_task(reconnector.run())
        await dht.redialled.wait()
        task.cancel()

    vclock.run(scenario())
    return dht.calls[0]


def test_a_node_alone_rebootstraps_from_initial_and_known_peers():
    dht = ScriptedDHT({"QmKnown": ["/ip4/10.0.0.2/tcp/5"], "QmBoot": ["/ip4/127.0.0.1/tcp/9"]}, {})
    assert first_dial(dht) == ["/ip4/127.0.0.1/tcp/9/p2p/QmBoot", "/ip4/10.0.0.2/tcp/5/p2p/QmKnown"]
    assert len(dht.calls) == 1


def test_a_node_dials_an_initial_peer_it_lost_again_even_when_connected_to_others():
    """A restarted bootstrap has forgotten the swarm, and the nodes' DHTs forgot the
    bootstrap when their calls to it failed: unless the nodes dial it, it stays empty."""
    dht = ScriptedDHT({"QmOther": ["/ip4/10.0.0.2/tcp/5"]})
    assert first_dial(dht) == ["/ip4/127.0.0.1/tcp/9/p2p/QmBoot"]
    assert len(dht.calls) == 1


def test_redials_back_off_while_they_fail_and_reset_once_one_succeeds():
    now = [0.0]
    backoff = Backoff(5.0, 20.0, clock=lambda: now[0])
    gaps = []
    for success in (False, False, False, False, True, False):
        assert backoff.due()
        backoff.done(success)
        gaps.append(backoff.next_at - now[0])
        now[0] = backoff.next_at - 0.001
        assert not backoff.due()
        now[0] += 0.001
    assert gaps == [10.0, 20.0, 20.0, 20.0, 5.0, 10.0]


SIGNAL_SCENARIO = """
import asyncio, json, os, signal
from swarm_node.net.dht import SwarmDHT


def caught_and_ignored(pid):
    lines = open(f"/proc/{pid}/status").read().splitlines()
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return int(fields["SigCgt"], 16), int(fields["SigIgn"], 16)


async def scenario():
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: None)
    dht = await SwarmDHT.start()
    pid = dht.dht.pid
    caught, ignored = caught_and_ignored(pid)
    os.kill(pid, signal.SIGTERM)
    died = False
    for _ in range(100):  # polling for the exit, 10 s at most
        if not dht.dht.is_alive():
            died = True
            break
        await asyncio.sleep(0.1)
    await dht.shutdown()
    print("RESULT", json.dumps([caught, ignored, died]))

asyncio.run(scenario())
"""


def test_the_dht_process_does_not_inherit_the_parents_signal_handlers():
    """SIGTERM must stop hivemind's DHT child even though the parent's event loop
    handles SIGTERM itself (otherwise the parent hangs at exit, joining the child). In a
    process of its own: a DHT child killed while it holds hivemind's process-wide
    MPFuture lock leaves that lock taken, and every later DHT of the same parent hangs
    at start (it deadlocked the rest of a test run once)."""
    out = subprocess.run([sys.executable, "-c", SIGNAL_SCENARIO], capture_output=True, text=True, timeout=120)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, out.stderr[-3000:]
    caught, ignored, died = json.loads(line.split(" ", 1)[1])
    assert not caught & (1 << (signal.SIGTERM - 1)) and ignored & (1 << (signal.SIGINT - 1))
    assert died

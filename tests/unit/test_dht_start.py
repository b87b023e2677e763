"""Starting the DHT when the initial peers are slow to answer: a peer that accepts TCP
connections but misses hivemind's 3-second ping (a bootstrap on a machine where 32
nodes start at once) is asked again, backing off, until the start-up timeout; a port
nobody listens on is an error at once."""

import socket

import pytest
import vclock

from swarm_node.net import dht as dht_module

PEER = "/ip4/127.0.0.1/tcp/{port}/p2p/QmThsSHm777ukMCEAP4cKZztG2bkbTbocai2dzyWhmbKEH"


def _silent_then_up(monkeypatch, silent_times: int) -> list[float]:
    calls = []

    async def start(kwargs, client_mode, initial_peers, timeout_s):
        import asyncio
        calls.append(asyncio.get_running_loop().time())
        if len(calls) <= silent_times:
            raise dht_module._InitialPeersSilent("none of the initial peers answered (...)")
        return "the dht"

    monkeypatch.setattr(dht_module, "_start_dht", start)
    return calls


def test_a_listening_but_slow_initial_peer_is_asked_again_with_back_off(monkeypatch):
    calls = _silent_then_up(monkeypatch, silent_times=3)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        peers = [PEER.format(port=listening.getsockname()[1])]
        started = vclock.run(dht_module._start_dht_patiently({}, False, peers, timeout_s=60.0))
    assert started == "the dht"
    assert [b - a for a, b in zip(calls, calls[1:])] == pytest.approx([2.0, 4.0, 8.0], abs=0.1)


def test_gives_up_at_the_start_up_timeout(monkeypatch):
    calls = _silent_then_up(monkeypatch, silent_times=100)
    monkeypatch.setattr(dht_module, "_any_port_listening", lambda maddrs: True)
    with pytest.raises(dht_module._InitialPeersSilent):
        vclock.run(dht_module._start_dht_patiently({}, False, [PEER.format(port=1)], timeout_s=20.0))
    # at 0, 2, 6 and 14 s; waiting 8 more would pass 20
    assert len(calls) == 4 and calls[-1] - calls[0] < 20.0


def test_a_port_nobody_listens_on_is_an_error_at_once(monkeypatch):
    calls = _silent_then_up(monkeypatch, silent_times=100)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        peers = [PEER.format(port=closed.getsockname()[1])]
        with pytest.raises(dht_module._InitialPeersSilent, match="none of the initial peers answered"):
            vclock.run(dht_module._start_dht_patiently({}, False, peers, timeout_s=60.0))
    assert len(calls) == 1

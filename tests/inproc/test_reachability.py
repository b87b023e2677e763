"""The dial-back protocol: a peer dials a joiner back over a fresh connection, only at
the address the joiner's connection came from; one success is enough, one failure is
not; hostile requests get a typed answer and make nobody dial anything."""

import asyncio
import random
import socket

from hivemind.utils.multiaddr import Multiaddr

from swarm_node.errors import PeerError, PeerRefused
from swarm_node.membership.reachability import Reachability, check_reachability
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.dialback import dialback_handler, ordered_for_others, serve_dialback, tcp_ports
from swarm_node.net.transport import Transport
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame

HOSTILE_FRAMES = 2_000
ANSWER_LIMITS = FrameLimits(max_header_bytes=4096, max_payload_bytes=0, max_tensors=0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 180))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_dials_the_joiner_back_and_finds_a_closed_port_closed():
    async def scenario():
        server = await SwarmDHT.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        joiner = await SwarmDHT.start(initial_peers=server.visible_maddrs()[:1],
                                      host_maddrs=["/ip4/0.0.0.0/tcp/0"])
        try:
            await serve_dialback(Transport(await server.replicate_p2p()))
            transport = Transport(await joiner.replicate_p2p())
            ports = tcp_ports(joiner.visible_maddrs())
            open_port = await check_reachability(transport, [server.peer_id], ports)
            closed = await check_reachability(transport, [server.peer_id], [nobody_listens])
            return ports, open_port, closed
        finally:
            await joiner.shutdown()
            await server.shutdown()

    nobody_listens = _free_port()
    ports, open_port, closed = run(scenario())
    assert len(ports) == 1
    assert open_port.reachable is True and open_port.observed == "/ip4/127.0.0.1"
    assert closed.reachable is False and list(closed.failures) == [f"/ip4/127.0.0.1/tcp/{nobody_listens}"]


def test_the_server_dials_only_where_the_connection_came_from():
    dialled = []

    async def dial(peer, targets, timeout_s):
        dialled.extend(targets)
        return {t: None for t in targets}

    handle = dialback_handler(lambda remote, why: None, dial)
    request = encode_frame({"kind": "dialback", "ports": [31338, 4001]})
    answer, _ = decode_frame(run(handle("QmCaller", request, Multiaddr("/ip4/198.51.100.7/tcp/52000"))),
                             ANSWER_LIMITS)
    assert dialled == ["/ip4/198.51.100.7/tcp/31338", "/ip4/198.51.100.7/tcp/4001"]
    assert answer["ok"] and answer["observed"] == "/ip4/198.51.100.7"
    relayed = Multiaddr(
        "/ip4/203.0.113.1/tcp/4001/p2p/QmThsSHm777ukMCEAP4cKZztG2bkbTbocai2dzyWhmbKEH/p2p-circuit"
    )
    answer, _ = decode_frame(run(handle("QmCaller", request, relayed)), ANSWER_LIMITS)
    assert not answer["ok"] and len(dialled) == 2  # nothing dialled through a relay


def test_hostile_dial_back_requests_get_typed_answers_count_as_faults_and_dial_nothing():
    rng = random.Random(7)
    dialled, faults = [], []

    async def dial(peer, targets, timeout_s):
        dialled.extend(targets)
        return {t: "refused" for t in targets}

    handle = dialback_handler(lambda remote, why: faults.append(remote), dial)
    valid = encode_frame({"kind": "dialback", "ports": [31338]})
    junk = [None, True, -1, 0, 65536, 2**40, 1.5, "31338", [31338], {"a": 1}]

    async def scenario():
        for i in range(HOSTILE_FRAMES):
            if i % 3 == 0:
                frame = rng.randbytes(rng.randint(0, 300))
            elif i % 3 == 1:
                frame = bytearray(valid)
                frame[rng.randrange(len(frame))] = rng.randrange(256)
                frame = bytes(frame)
            else:
                ports = [rng.choice(junk) for _ in range(rng.randint(0, 6))]
                frame = encode_frame({"kind": rng.choice(["dialback", "status", ""]), "ports": ports})
            answer = await handle(f"QmFuzz{i % 5}", frame, Multiaddr("/ip4/198.51.100.7/tcp/1"))
            header, _ = decode_frame(answer, ANSWER_LIMITS)
            assert header["kind"] == "dialback"
            if not header["ok"]:
                assert header["error"].startswith("protocol")

    run(scenario())
    assert faults and set(faults) <= {f"QmFuzz{i}" for i in range(5)}
    assert all(t.startswith("/ip4/198.51.100.7/tcp/") for t in dialled)  # only ever the caller's own address


class FakeTransport:
    """Answers dial-back requests from a script: server -> (observed, results) or an error."""

    peer_id = "QmMe"

    def __init__(self, script):
        self.script = script
        self.asked = []

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
        self.asked.append(peer)
        answer = self.script[peer]
        if isinstance(answer, list):  # several answers in turn (busy first, say)
            answer = answer.pop(0)
        if isinstance(answer, Exception):
            raise answer
        observed, results = answer
        return encode_frame({"kind": "dialback", "ok": True, "observed": observed, "results": results})


def test_one_success_is_enough_and_one_failure_is_not(monkeypatch):
    monkeypatch.setattr("swarm_node.membership.reachability.BUSY_PAUSE_S", (0.0, 0.0))
    liar = ("/ip4/198.51.100.7", {"31338": "refused"})
    honest = ("/ip4/198.51.100.7", {"31338": None})
    reach = run(check_reachability(FakeTransport({"QmA": liar, "QmB": honest}), ["QmA", "QmB"], [31338]))
    assert reach == Reachability(True, "/ip4/198.51.100.7", ("QmA", "QmB"))
    two_failures = FakeTransport({"QmA": liar, "QmB": liar, "QmC": honest})
    reach = run(check_reachability(two_failures, ["QmA", "QmB", "QmC"], [31338]))
    assert reach.reachable is False and two_failures.asked == ["QmA", "QmB"]  # two answers decide
    busy_then_ok = FakeTransport({"QmA": [PeerRefused("busy"), PeerRefused("busy"), honest]})
    assert run(check_reachability(busy_then_ok, ["QmA"], [31338])).reachable is True
    silent = FakeTransport({"QmA": PeerRefused("busy"), "QmB": PeerError("stream closed mid-frame")})
    monkeypatch.setattr("swarm_node.membership.reachability.BUSY_RETRIES", 0)
    assert run(check_reachability(silent, ["QmA", "QmB"], [31338])).reachable is None


def test_addresses_for_others_put_public_first_and_container_names_last():
    peer = "/p2p/QmThsS"
    maddrs = [f"/ip4/127.0.0.1/tcp/1{peer}", f"/dns4/bootstrap/tcp/1{peer}", f"/ip4/10.1.2.3/tcp/1{peer}",
              f"/ip4/8.8.4.4/tcp/1{peer}", f"/dns4/boot.example.org/tcp/1{peer}"]
    assert ordered_for_others(maddrs) == [f"/ip4/8.8.4.4/tcp/1{peer}", f"/dns4/boot.example.org/tcp/1{peer}",
                                          f"/ip4/10.1.2.3/tcp/1{peer}", f"/ip4/127.0.0.1/tcp/1{peer}",
                                          f"/dns4/bootstrap/tcp/1{peer}"]
    assert tcp_ports(["/ip4/127.0.0.1/tcp/5/p2p/Qm", "/ip4/10.0.0.2/tcp/6/p2p/Qm",
                      "/ip4/0.0.0.0/tcp/7"]) == [6]


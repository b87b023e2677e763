"""Direct lanes (net/lanes.py) between real libp2p peers: a bulk protocol's requests go
over one TLS lane (opened once, then reused) with the same answers, paced bodies and
caps as on libp2p streams; control protocols stay on libp2p; a peer without lanes, a
lane whose certificate is not the one the offer named, or a forged ticket never gets
a request through a lane, and the callers still get their answers over libp2p."""

from __future__ import annotations

import asyncio
import os
import ssl

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarm_node.errors import PeerRefused, ProtocolError
from swarm_node.net import lanes, protocols
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.lanes import LANE_HELLO, Offer, Tickets
from swarm_node.net.transport import ServeLimits, Transport

BULK = protocols.FORWARD  # any bulk protocol: the transport does not look inside
BULK_PACED = protocols.OUTER
CONTROL = protocols.STATUS
LOOPBACK = ["127.0.0.1"]
HELD: asyncio.Event  # set by the test that holds requests, once the others have their answers


async def two_peers(*, server_lanes: bool = True, client_lanes: bool = True, tls: bool = True):
    global HELD
    HELD = asyncio.Event()  # of this test's loop
    server, client = await SwarmDHT.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"]), await SwarmDHT.start(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    await client.rebootstrap(server.visible_maddrs())
    faults = []
    serving = Transport(await server.replicate_p2p(), on_fault=lambda peer, why: faults.append((peer, why)))
    calling = Transport(await client.replicate_p2p())
    seen = []  # (protocol, caller, how the request came: its remote address)

    def recorder(protocol):
        async def handler(remote: str, request: bytes, addr) -> bytes:
            seen.append((protocol, remote, str(addr)))
            if request == b"hold":  # until the test lets go: every other request must meet it held
                await HELD.wait()
            return request[::-1]
        return handler

    for protocol, paced in ((BULK, False), (BULK_PACED, True), (CONTROL, False)):
        await serving.serve(protocol, recorder(protocol), ServeLimits(max_request_bytes=64 << 20, max_per_peer=2,
                                                                      paced_request=paced, paced_response=paced),
                            with_address=True)
    lane_port = await serving.open_lanes(LOOPBACK, 0) if server_lanes else None
    if client_lanes:  # TLS even on loopback, as between hosts, unless a test asks for the loopback shortcut
        await calling.open_lanes(LOOPBACK, 0, encrypt_loopback=tls)
    return server, client, serving, calling, seen, faults, lane_port


async def close(*dhts, transports=()):
    for transport in transports:
        await transport.close_lanes()
    for dht in dhts:
        await dht.shutdown()


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain on loopback"])
def test_bulk_requests_share_one_lane_with_libp2p_answers_and_control_stays_on_libp2p(tls):
    async def scenario():
        server, client, serving, calling, seen, faults, lane_port = await two_peers(tls=tls)
        try:
            big = os.urandom(24 << 20)
            answers = [await calling.request(server.peer_id, BULK, f"hello {i}".encode(), timeout_s=30,
                                             max_response_bytes=1 << 20) for i in range(5)]
            paced = await calling.request(server.peer_id, BULK_PACED, big, timeout_s=60, max_response_bytes=32 << 20,
                                          paced_request=True, paced_response=True)
            status = await calling.request(server.peer_id, CONTROL, b"status?", timeout_s=30, max_response_bytes=1024)
            return (answers, paced == big[::-1], status, seen, calling.lanes.lanes_opened,
                    serving._lane_server.requests, faults, client.peer_id)
        finally:
            await close(server, client, transports=(serving, calling))

    answers, paced_ok, status, seen, opened, over_lanes, faults, caller = asyncio.run(
        asyncio.wait_for(scenario(), 120))
    assert answers == [f"hello {i}".encode()[::-1] for i in range(5)] and paced_ok and status == b"?sutats"
    assert opened == 1  # six bulk requests, one after the other, on one lane
    assert over_lanes == 6 and [protocol for protocol, _, _ in seen] == [BULK] * 5 + [BULK_PACED, CONTROL]
    lane_address = seen[0][2]
    assert {addr for _, _, addr in seen[:6]} == {lane_address} and seen[6][2] != lane_address
    assert {caller for _, caller, _ in seen} == {caller}  # the ticket said whose lane it is
    assert not faults


def test_concurrent_requests_open_several_lanes_and_caps_hold_on_lanes():
    """Per-caller caps are the protocol's, whichever path a request takes: with
    max_per_peer 2, five held requests at once get two answers and three busy."""
    async def scenario():
        server, client, serving, calling, seen, faults, _ = await two_peers()
        try:
            calls = [asyncio.create_task(calling.request(server.peer_id, BULK, b"hold", timeout_s=60,
                                                         max_response_bytes=1024)) for _ in range(5)]
            while sum(call.done() for call in calls) < 3:  # the three told busy while two are held
                await asyncio.wait([c for c in calls if not c.done()], return_when=asyncio.FIRST_COMPLETED)
            HELD.set()
            results = await asyncio.gather(*calls, return_exceptions=True)
            again = await calling.request(server.peer_id, BULK, b"again", timeout_s=30, max_response_bytes=1024)
            return results, again, calling.lanes.lanes_opened
        finally:
            await close(server, client, transports=(serving, calling))

    results, again, opened = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert sum(r == b"dloh" for r in results) == 2
    assert sum(isinstance(r, PeerRefused) for r in results) == 3, results
    assert again == b"niaga"
    assert 2 <= opened <= lanes.MAX_LANES_PER_PEER  # a busy answer leaves its lane usable


@pytest.mark.parametrize("case", ["server without lanes", "certificate not the offer's"])
def test_no_usable_lane_means_libp2p_with_the_same_answers(case, monkeypatch, caplog):
    async def scenario():
        server, client, serving, calling, seen, faults, _ = await two_peers(server_lanes=case != "server without "
                                                                                                "lanes")
        if case == "certificate not the offer's":  # a man in the middle: another key answers the dial
            serving._lane_server.identity.cert_sha256 = bytes(32)
        try:
            answers = [await calling.request(server.peer_id, BULK, b"abc", timeout_s=30, max_response_bytes=1024)
                       for _ in range(3)]
            over_lanes = serving._lane_server.requests if serving._lane_server else 0
            return answers, calling.lanes.lanes_opened, over_lanes, calling.lanes.direct_to(server.peer_id)
        finally:
            await close(server, client, transports=(serving, calling))

    with caplog.at_level("INFO", logger="swarm_node.net.lanes"):
        answers, opened, over_lanes, direct = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert answers == [b"cba"] * 3 and opened == 0 and over_lanes == 0 and not direct
    said = [r.getMessage() for r in caplog.records if "no direct lane" in r.getMessage()]
    assert len(said) == 1, said  # logged once, however many requests fell back


def test_a_lane_with_a_forged_ticket_carries_nothing():
    async def scenario():
        server, client, serving, calling, seen, faults, lane_port = await two_peers(client_lanes=False)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", lane_port, ssl=context)
            name = BULK.encode()
            writer.write(LANE_HELLO + os.urandom(32) + bytes([len(name)]) + name + (3).to_bytes(8, "big") + b"abc")
            await writer.drain()
            leftover = await asyncio.wait_for(reader.read(), 10)  # the server closes without an answer
            writer.close()
            return leftover, seen, serving._lane_server.requests
        finally:
            await close(server, client, transports=(serving,))

    leftover, seen, over_lanes = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert leftover == b"" and seen == [] and over_lanes == 0


def test_tickets_are_bounded_expire_and_belong_to_whoever_asked():
    now = [0.0]
    tickets = Tickets(clock=lambda: now[0])
    mine = [tickets.issue("peer-a") for _ in range(lanes.MAX_TICKETS_PER_PEER + 2)]
    assert tickets.redeem(mine[0]) is None and tickets.redeem(mine[-1]) == "peer-a"  # a peer keeps its newest
    other = tickets.issue("peer-b")
    now[0] += lanes.TICKET_TTL_S + 1
    assert tickets.redeem(other) is None and tickets.redeem(os.urandom(32)) is None
    for i in range(lanes.MAX_TICKETS + 10):
        tickets.issue(f"peer-{i}")
    assert len(tickets._peer_of) <= lanes.MAX_TICKETS


@given(st.binary(max_size=300))
def test_an_offer_parses_or_is_a_protocol_error(raw):
    try:
        offer = Offer.from_wire(raw, "10.0.0.1", now=100.0)
    except ProtocolError:
        return
    assert 0 < offer.port < 65536 and len(offer.ticket) == lanes.TICKET_BYTES and offer.expires_at <= 100.0 + \
        lanes.TICKET_TTL_S


@given(st.integers(0, 70000), st.binary(min_size=0, max_size=40), st.binary(min_size=0, max_size=40),
       st.one_of(st.floats(allow_nan=True), st.integers(-10, 10**9), st.booleans(), st.none()))
def test_a_well_formed_offer_round_trips_and_a_bent_one_is_refused(port, cert, ticket, ttl):
    import msgpack

    raw = msgpack.packb({"port": port, "cert": cert, "ticket": ticket, "ttl": ttl})
    valid = (0 < port < 65536 and len(cert) == 32 and len(ticket) == lanes.TICKET_BYTES
             and isinstance(ttl, int | float) and not isinstance(ttl, bool) and ttl == ttl)  # NaN is no lifetime
    if valid:
        offer = Offer.from_wire(raw, "10.0.0.1", now=0.0)
        assert (offer.port, offer.cert_sha256, offer.ticket) == (port, cert, ticket)
        assert 0.0 <= offer.expires_at <= lanes.TICKET_TTL_S
    else:
        with pytest.raises(ProtocolError):
            Offer.from_wire(raw, "10.0.0.1", now=0.0)


def test_a_control_protocol_asked_on_a_lane_is_a_fault_of_the_ticket_holder():
    async def scenario():
        server, client, serving, calling, seen, faults, lane_port = await two_peers(client_lanes=False)
        ticket = serving._tickets.issue(client.peer_id)  # as the offer would give it to the client
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", lane_port)  # loopback: plain TCP
            name = CONTROL.encode()
            writer.write(LANE_HELLO + ticket + bytes([len(name)]) + name + (3).to_bytes(8, "big") + b"abc")
            await writer.drain()
            leftover = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return leftover, seen, faults, client.peer_id
        finally:
            await close(server, client, transports=(serving,))

    leftover, seen, faults, caller = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert leftover == b"" and seen == []
    assert [peer for peer, _ in faults] == [caller] and "does not carry it" in faults[0][1]


def test_connections_that_never_finish_their_handshake_are_bounded(monkeypatch):
    """Each connection holds a thread from accept on, so silent ones count against the
    cap before any ticket: past it, a connection is closed at once."""
    monkeypatch.setattr(lanes, "MAX_INBOUND", 3)

    async def scenario():
        server, client, serving, calling, seen, faults, lane_port = await two_peers(client_lanes=False)
        try:
            silent = [await asyncio.open_connection("127.0.0.1", lane_port) for _ in range(3)]
            lane_server = serving._lane_server
            async with asyncio.timeout(10):  # until the server holds all three
                while len(lane_server._accepting) - len(lane_server._listeners) < 3:
                    await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection("127.0.0.1", lane_port)
            closed_at_once = await asyncio.wait_for(reader.read(), 3) == b""
            held = [not r.at_eof() for r, _ in silent]
            for _, w in [*silent, (reader, writer)]:
                w.close()
            return closed_at_once, held
        finally:
            await close(server, client, transports=(serving,))

    closed_at_once, held = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert closed_at_once and all(held)

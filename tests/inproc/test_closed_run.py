"""A closed run: only listed peer ids are served, paired with or shown; a node that is
not on the list is told so at start."""

import asyncio
import dataclasses
import logging

import pytest
from parts import FakeDHT
from swarm_bootstrap.view import SwarmView

from swarm_node import __version__
from swarm_node.errors import IncompatibleRun, PeerError
from swarm_node.membership.view import Membership
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.guard import PeerGuard
from swarm_node.net.transport import ServeLimits, Transport
from swarm_node.node.conductor import Node
from swarm_node.node_config import NodeConfig
from swarm_node.spec import RunSpec
from swarm_node.wire.records import PeerRecord

OPEN = RunSpec(run_id="closed")


def test_only_admitted_callers_are_served_by_their_authenticated_peer_id():
    async def scenario():
        server, member, stranger = [await SwarmDHT.start() for _ in range(3)]
        try:
            closed = dataclasses.replace(OPEN, allowed_peers=(server.peer_id, member.peer_id))
            serving = Transport(await server.replicate_p2p())

            async def echo(remote: str, request: bytes) -> bytes:
                return b"served " + request

            await serving.serve("swarm-node/test/1", echo, ServeLimits(max_request_bytes=1024),
                                authorize=closed.admits)
            maddr = server.visible_maddrs()
            await member.rebootstrap(maddr)
            await stranger.rebootstrap(maddr)
            ok = await Transport(await member.replicate_p2p()).request(
                server.peer_id, "swarm-node/test/1", b"hello", timeout_s=10, max_response_bytes=1024)
            with pytest.raises(PeerError):
                await Transport(await stranger.replicate_p2p()).request(
                    server.peer_id, "swarm-node/test/1", b"hello", timeout_s=10, max_response_bytes=1024)
            return ok
        finally:
            for d in (server, member, stranger):
                await d.shutdown()

    assert asyncio.run(asyncio.wait_for(scenario(), 120)) == b"served hello"


def test_records_of_peers_not_on_the_list_are_ignored_by_nodes_and_the_dashboard(caplog):
    closed = dataclasses.replace(OPEN, allowed_peers=("QmMember1", "QmMember2"))
    record = PeerRecord(stage=1, spec_hash=closed.spec_hash(), version=__version__).to_wire()
    dht = FakeDHT("QmMember1", {"closed/stage/1": {"QmMember2": record, "QmStranger": record}})
    membership = Membership(spec=closed, dht=dht, guard=PeerGuard(), config=NodeConfig(), record=lambda: None)
    with caplog.at_level(logging.WARNING):
        asyncio.run(membership.refresh(all_stages=True))
    assert set(membership.peers[1]) == {"QmMember2"}
    assert any("not on this closed run's list" in r.getMessage() for r in caplog.records)
    view = SwarmView("closed", closed.spec_hash(), 2, frozenset(closed.allowed_peers))
    view.ingest(1.0, {p: PeerRecord.from_wire(record) for p in ("QmMember2", "QmStranger")})
    assert set(view.peers) == {"QmMember2"} and view.foreign_records == 1


def test_a_node_not_on_the_list_is_told_so_at_start():
    closed = dataclasses.replace(OPEN, allowed_peers=("QmSomebodyElse",))
    with pytest.raises(IncompatibleRun, match="is closed and this node's peer id .* is not on its list"):
        asyncio.run(asyncio.wait_for(Node(closed, NodeConfig(progress=False)).run(), 120))

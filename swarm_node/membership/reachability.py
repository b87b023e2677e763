"""Whether other peers can reach this node, asked of them when it joins: peers dial it
back over a fresh connection (the dial-back protocol, net/dialback.py). A node nobody
can dial runs its DHT as a client, tells the others (its record says so), and takes only
roles that need no inbound connection: stage 0, and pairs it proposes itself."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from swarm_node.errors import PeerError, PeerRefused, ProtocolError
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.dialback import (
    ASK_TIMEOUT_S,
    DIALBACK,
    DIALBACK_LIMITS,
    MAX_ADDRESSES_CHECKED,
    address_scope,
    tcp_ports,
)
from swarm_node.net.transport import Transport, short_id
from swarm_node.spec import RunSpec
from swarm_node.spec_record import peer_ids_of
from swarm_node.wire.frames import decode_frame, encode_frame

log = logging.getLogger(__name__)

BUSY_RETRIES = 4  # volunteers who start together ask the bootstrap at the same moment
BUSY_PAUSE_S = (0.5, 2.0)


@dataclass(frozen=True)
class Reachability:
    """What peers measured by dialling this node back. ``reachable`` is None when nobody
    could check (no peer answered the request)."""
    reachable: bool | None
    observed: str | None = None  # our address as the checking peer saw it
    checked_by: tuple[str, ...] = ()
    failures: dict[str, str] = field(default_factory=dict)  # "/ip4/A/tcp/P" -> why it did not answer

    def unreachable_at(self) -> str:
        return "; ".join(f"{addr}: {why}" for addr, why in self.failures.items())


async def check_reachability(transport: Transport, servers: Sequence[str], ports: Sequence[int], *,
                             max_answers: int = 2) -> Reachability:
    """Ask ``servers`` in turn to dial us back on ``ports``. Reachable as soon as one
    reached us; unreachable when ``max_answers`` peers (or every peer that answered)
    failed to: one peer's own broken network, or a lie, does not decide alone."""
    request = encode_frame({"kind": "dialback", "ports": list(ports)[:MAX_ADDRESSES_CHECKED]})
    checked_by: list[str] = []
    failures: dict[str, str] = {}
    observed = None
    for server in dict.fromkeys(servers):
        if server == transport.peer_id:
            continue
        try:
            header, results = await _ask(transport, server, request)
        except PeerError as exc:
            log.debug("dial-back by %s failed: %s", short_id(server), exc)
            continue
        checked_by.append(server)
        observed = header["observed"]
        if any(why is None for why in results.values()):
            return Reachability(True, observed, tuple(checked_by))
        failures.update({f"{observed}/tcp/{port}": why for port, why in results.items()})
        if len(checked_by) >= max_answers:
            break
    return Reachability(False if checked_by else None, observed, tuple(checked_by), failures)


async def _ask(transport: Transport, server: str, request: bytes) -> tuple[dict, dict[str, str | None]]:
    for attempt in range(BUSY_RETRIES + 1):
        try:
            raw = await transport.request(server, DIALBACK, request, timeout_s=ASK_TIMEOUT_S,
                                          max_response_bytes=4096)
        except PeerRefused:  # busy checking others
            if attempt == BUSY_RETRIES:
                raise
            await asyncio.sleep(random.uniform(*BUSY_PAUSE_S))  # a back-off, not synchronisation
            continue
        header, _ = decode_frame(raw, DIALBACK_LIMITS)
        return header, _results(header)
    raise AssertionError("not reached")


def _results(header: dict) -> dict[str, str | None]:
    if not header.get("ok"):
        raise PeerError(str(header.get("error", "refused"))[:200])
    results, observed = header.get("results"), header.get("observed")
    if (not isinstance(results, dict) or not isinstance(observed, str) or len(observed) > 64
            or not all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in results.items())):
        raise ProtocolError("malformed dial-back answer")
    return {k[:8]: v if v is None else v[:200] for k, v in list(results.items())[:MAX_ADDRESSES_CHECKED]}


class OwnView(Protocol):
    """What the check reads and sets of the node's view of the run (membership/view.py's
    Membership, which holds the answer)."""
    spec: RunSpec
    reachability: Reachability | None

    def callable_peers(self, stage: int) -> list[str]: ...


async def check_own_reachability(dht: SwarmDHT, transport: Transport, membership: OwnView,
                                 initial_peers: tuple[str, ...], host_maddrs: tuple[str, ...]) -> bool:
    """Sets ``membership.reachability``; True when the node must go on as a DHT client."""
    if dht.client_mode:  # asked for, or hivemind's own check failed already
        membership.reachability = Reachability(False)
        return False
    ports = tcp_ports(dht.visible_maddrs())
    if not ports:  # listening on loopback only
        if all(address_scope(m) == "loopback" for m in initial_peers):
            return False  # a swarm on this machine, where everyone can dial everyone
        log.warning("this node listens on loopback only (%s), so peers on other machines cannot reach it: it "
                    "trains stage 0 and starts its own pairings, and nobody routes work to it. To take any "
                    "stage, listen on every interface: leave out --host-maddrs", " ".join(host_maddrs))
        membership.reachability = Reachability(False)
        return True
    others = [p for s in range(membership.spec.num_stages) for p in membership.callable_peers(s)]
    random.shuffle(others)
    result = await check_reachability(transport, [*peer_ids_of(initial_peers), *others], ports)
    membership.reachability = result
    if result.reachable is None:
        log.warning("could not check whether other peers can reach this node (no peer answered a dial-back "
                    "request); assuming they can")
    elif result.reachable:
        log.info("reachability: %s dialled this node back at %s", short_id(result.checked_by[-1]),
                 result.observed)
    else:
        log.warning(
            "this node cannot be reached by other peers (%s dialled it back at %s in vain): it trains "
            "stage 0 and starts its own pairings, and nobody routes work to it. To take any stage, %s",
            ", ".join(short_id(p) for p in result.checked_by),
            ", ".join(result.failures),
            open_port_advice(dht),
        )
        log.debug("dial-back failures: %s", result.unreachable_at())
    return result.reachable is False


def open_port_advice(dht: SwarmDHT) -> str:
    ports = tcp_ports(dht.visible_maddrs()) or ["PORT"]
    return (f"forward TCP port {ports[0]} on your router to this machine (and open it in its firewall), then "
            f"start again with --public-ip YOUR_PUBLIC_IP --port {ports[0]}")

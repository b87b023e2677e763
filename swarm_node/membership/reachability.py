"""Whether other peers can reach this node, asked of them when it joins: peers dial it
back over a fresh connection (net/dialback.py). A node nobody can dial runs its DHT as a
client, tells the others (its record says so), and takes only roles that need no
inbound connection: stage 0, and pairs it proposes itself."""

from __future__ import annotations

import logging
import random

from swarm_node.membership.discovery import peer_ids_of
from swarm_node.membership.view import Membership
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.dialback import Reachability, address_scope, check_reachability, tcp_ports
from swarm_node.net.transport import Transport, short_id

log = logging.getLogger(__name__)


async def check_own_reachability(dht: SwarmDHT, transport: Transport, membership: Membership,
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
        log.info("reachability: %s dialled this node back at %s", short_id(result.checked_by[-1]), result.observed)
    else:
        log.warning("this node cannot be reached by other peers (%s dialled it back at %s in vain): it trains "
                    "stage 0 and starts its own pairings, and nobody routes work to it. To take any stage, %s",
                    ", ".join(short_id(p) for p in result.checked_by), ", ".join(result.failures),
                    open_port_advice(dht))
        log.debug("dial-back failures: %s", result.unreachable_at())
    return result.reachable is False


def open_port_advice(dht: SwarmDHT) -> str:
    ports = tcp_ports(dht.visible_maddrs()) or ["PORT"]
    return (f"forward TCP port {ports[0]} on your router to this machine (and open it in its firewall), then "
            f"start again with --public-ip YOUR_PUBLIC_IP --port {ports[0]}")

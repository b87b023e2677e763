"""Can a peer be reached at the addresses it announces? Two checks, both dialled from a
throwaway libp2p daemon, so they go through the same transport, security handshake and
peer-id check a volunteer's node would use, over a fresh connection (an existing one
would prove nothing: a node behind a NAT can be called back over the connection it
opened itself).

- ``dial_check``: the bootstrap dials its own announced addresses at start-up.
- The dial-back protocol (``/swarm-node/dialback/1.0.0``): a joining node asks a peer to
  dial it back (the asking side: membership/reachability.py; the serving side is here).
  Like libp2p's AutoNAT, the server dials only the address the caller's
  connection came from (with the ports the caller names), never an address the caller
  merely claims, so it cannot be used to make us dial third parties."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Sequence

from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm_node.errors import ProtocolError
from swarm_node.net.refusals import Refusals
from swarm_node.net.transport import ServeLimits, Transport, short_id
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame

log = logging.getLogger(__name__)

DIALBACK = "/swarm-node/dialback/1.0.0"  # "dial me back on these ports": a few bytes each way
MAX_ADDRESSES_CHECKED = 4
DIAL_TIMEOUT_S = 8.0
ASK_TIMEOUT_S = 2 * MAX_ADDRESSES_CHECKED * DIAL_TIMEOUT_S  # the server dials each port in turn
DIALBACK_LIMITS = FrameLimits(max_header_bytes=1024, max_payload_bytes=0, max_tensors=0)
DIALBACK_SERVE_LIMITS = ServeLimits(max_request_bytes=1024, max_concurrent=4, max_per_peer=1,
                                    handler_timeout_s=ASK_TIMEOUT_S)


async def dial_check(peer_id: str, maddrs: Sequence[str], timeout_s: float = 10.0) -> dict[str, str | None]:
    """For each address (without /p2p/), None when ``peer_id`` answered there, else why not.
    Each address gets its own daemon: libp2p would reuse the first connection."""
    results: dict[str, str | None] = {}
    for text in list(maddrs)[:MAX_ADDRESSES_CHECKED]:
        probe = None
        try:
            async with asyncio.timeout(timeout_s):
                probe = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                await probe._client.connect(PeerID.from_base58(peer_id), [Multiaddr(text)])
            results[text] = None
        except TimeoutError:
            results[text] = f"no answer within {timeout_s:.0f}s"
        except (P2PDaemonError, ConnectionError, OSError, ValueError) as exc:
            results[text] = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        finally:
            if probe is not None:
                await probe.shutdown()
    return results


# -- the dial-back protocol -------------------------------------------------------------

Fault = Callable[[str, str], None]  # (caller, why): a malformed request, counted against the caller
Dial = Callable[[str, Sequence[str], float], Awaitable[dict[str, str | None]]]


async def serve_dialback(transport: Transport, authorize=lambda remote: True,
                         on_fault: Fault | None = None) -> None:
    """Answer dial-back requests: bootstraps and nodes both serve them, so a joiner can
    ask whoever it reached first."""
    await transport.serve(DIALBACK, dialback_handler(on_fault or _log_once(transport.refusals)),
                          DIALBACK_SERVE_LIMITS, authorize=authorize, with_address=True)


def dialback_handler(on_fault: Fault, dial: Dial = dial_check):
    async def handle(remote: str, request: bytes, observed: Multiaddr) -> bytes:
        try:
            ports = _requested_ports(request)
        except ProtocolError as exc:
            on_fault(remote, f"bad dial-back request ({exc})")
            return encode_frame({"kind": "dialback", "ok": False, "error": f"protocol: {exc}"[:200]})
        host = observed_host(observed)
        if host is None:  # relayed, or an address family we cannot dial back
            return encode_frame({"kind": "dialback", "ok": False,
                                 "error": f"cannot dial back {observed}"[:200]})
        targets = [f"{host}/tcp/{port}" for port in ports]
        results = await dial(remote, targets, DIAL_TIMEOUT_S)
        log.debug("dial-back for %s: %s", short_id(remote), results)
        return encode_frame({"kind": "dialback", "ok": True, "observed": host,
                             "results": {target.rsplit("/",
                                                       1)[1]: results.get(target) for target in targets}})

    return handle


def _log_once(refusals: Refusals, max_peers: int = 4096) -> Fault:
    """A fault where no guard counts it (a bootstrap): counted as malformed, logged once a peer."""
    seen: set[str] = set()

    def fault(remote: str, why: str) -> None:
        refusals.count("malformed")
        if remote not in seen:
            if len(seen) >= max_peers:
                seen.clear()  # bounded: at worst a peer is logged a second time
            seen.add(remote)
            log.warning("peer %s: %s", short_id(remote), why)

    return fault


def _requested_ports(request: bytes) -> list[int]:
    header, _ = decode_frame(request, DIALBACK_LIMITS)
    ports = header.get("ports")
    if header.get("kind") != "dialback" or not isinstance(ports, list) or not ports:
        raise ProtocolError("not a dial-back request")
    if len(ports) > MAX_ADDRESSES_CHECKED or not all(type(p) is int and 0 < p < 65536 for p in ports):
        raise ProtocolError(f"at most {MAX_ADDRESSES_CHECKED} TCP ports, 1-65535")
    return list(dict.fromkeys(ports))


def observed_host(addr: Multiaddr) -> str | None:
    """``/ip4/A`` or ``/ip6/A`` of a connection's remote address; None when relayed."""
    names = [p.name for p in addr.protocols()]
    if "p2p-circuit" in names:
        return None
    for family in ("ip4", "ip6"):
        if family in names:
            return f"/{family}/{addr.value_for_protocol(family)}"
    return None


# -- addresses ---------------------------------------------------------------------------

def address_scope(maddr: str) -> str:
    """'loopback', 'private', 'public', 'unspecified', 'dns' or 'local-name' for a
    multiaddr (a one-label DNS name such as a container's service name resolves only
    on its own network)."""
    parts = maddr.strip("/").split("/")
    if len(parts) < 2:
        return "unknown"
    if parts[0].startswith("dns"):
        return "dns" if "." in parts[1].strip(".") else "local-name"
    try:
        ip = ipaddress.ip_address(parts[1])
    except ValueError:
        return "unknown"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_private or ip.is_link_local:
        return "private"
    return "public"


def ordered_for_others(maddrs: Sequence[str]) -> list[str]:
    """Public addresses first, loopback and names only a local network resolves (a
    container's service name) last: the first one is what people copy."""
    rank = {"public": 0, "dns": 0, "private": 1, "unknown": 2, "loopback": 3, "local-name": 4,
            "unspecified": 5}
    return sorted(dict.fromkeys(maddrs), key=lambda m: rank.get(address_scope(m), 2))


def tcp_ports(maddrs: Sequence[str]) -> list[int]:
    """The TCP ports of ``maddrs`` others could dial (loopback and wildcard ones left out)."""
    ports = []
    for text in maddrs:
        parts = text.strip("/").split("/")
        if "tcp" in parts and address_scope(text) not in ("loopback", "unspecified"):
            port = parts[parts.index("tcp") + 1]
            if port.isdigit() and int(port) > 0:
                ports.append(int(port))
    return list(dict.fromkeys(ports))

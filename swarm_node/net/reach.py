"""Can a peer be reached at the addresses it announces? Dialled from a throwaway
libp2p daemon in this process, so the check goes through the same transport, security
handshake and peer-id check a volunteer's node would use."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Sequence

from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils.multiaddr import Multiaddr

log = logging.getLogger(__name__)

MAX_ADDRESSES_CHECKED = 4


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


def address_scope(maddr: str) -> str:
    """'loopback', 'private', 'public', 'unspecified' or 'dns' for an /ip4|ip6|dns address."""
    parts = maddr.strip("/").split("/")
    if len(parts) < 2:
        return "unknown"
    if parts[0].startswith("dns"):
        return "dns"
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

"""Whether a peer behind a registry record exists: it answers a status request
(``/swarm-node/status/1.0.0``, a few hundred bytes). Anyone can sign a record for a
fresh key; only a running peer answers, and "busy" is an answer too (only the key's holder
can send it, and a joiner's witness kept busy must still count as one). Joiners ask
before choosing donors and witnesses, bootstraps before counting a peer."""

from __future__ import annotations

from swarm_node.errors import PeerError, PeerRefused
from swarm_node.net import protocols
from swarm_node.net.transport import Requester
from swarm_node.wire.messages import STATUS_REPLY_MAX_BYTES, STATUS_REQUEST


async def answers_status(requester: Requester, peer: str, timeout_s: float) -> bool:
    try:
        await requester.request(peer, protocols.STATUS, STATUS_REQUEST, timeout_s=timeout_s,
                                max_response_bytes=STATUS_REPLY_MAX_BYTES)
        return True
    except PeerRefused:  # busy: it exists
        return True
    except (PeerError, TimeoutError):
        return False

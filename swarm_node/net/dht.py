"""The hivemind DHT: start-up with clear failure messages, and small records with expiry.

Records are dictionaries keyed by subkey (one per peer), each entry expiring on its
own, which makes a natural per-stage registry. Values must stay small (a few KB)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence

from hivemind import DHT
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from swarm_node.errors import ConfigError, SwarmError

log = logging.getLogger(__name__)


class SwarmDHT:
    def __init__(self, dht: DHT):
        self.dht = dht
        self.peer_id = str(dht.peer_id)

    @classmethod
    async def start(cls, *, initial_peers: Sequence[str] = (), host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
                    announce_maddrs: Sequence[str] = (), identity_path: str | None = None,
                    client_mode: bool = False, startup_timeout_s: float = 60.0) -> "SwarmDHT":
        kwargs = dict(initial_peers=list(initial_peers), host_maddrs=list(host_maddrs), start=True,
                      client_mode=client_mode, startup_timeout=startup_timeout_s)
        if announce_maddrs:
            kwargs["announce_maddrs"] = list(announce_maddrs)
        if identity_path:
            kwargs["identity_path"] = identity_path
        try:
            # DHT() blocks while its child process and p2pd start: keep the loop free.
            dht = await asyncio.to_thread(DHT, **kwargs)
        except Exception as exc:  # hivemind raises bare Exceptions for all of these
            raise _explain_start_failure(exc, initial_peers, startup_timeout_s) from None
        return cls(dht)

    def is_alive(self) -> bool:
        """hivemind runs the DHT in a child process; it can die under us (OOM killer, kill)."""
        return self.dht.is_alive()

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    async def replicate_p2p(self) -> P2P:
        return await self.dht.replicate_p2p()

    async def store(self, key: str, subkey: str, value, ttl_s: float) -> bool:
        return bool(await self.dht.store(key, value, get_dht_time() + ttl_s, subkey=subkey, return_future=True))

    async def get_subkeys(self, key: str) -> dict[str, object]:
        """Live entries of a dictionary record (expired ones are dropped by the DHT)."""
        found = await self.dht.get(key, latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(sub): entry.value for sub, entry in found.value.items() if hasattr(entry, "value")}

    async def shutdown(self) -> None:
        """Stop the DHT process. Runs on a daemon thread: if the child is wedged and the
        caller gives up waiting, the thread must not keep this process from exiting."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def stop() -> None:
            try:
                self.dht.shutdown()
            finally:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        threading.Thread(target=stop, name="dht-shutdown", daemon=True).start()
        await done


def _explain_start_failure(exc: Exception, initial_peers: Sequence[str], timeout_s: float) -> SwarmError:
    text = str(exc)
    if "failed to start in" in text or "Daemon failed to start" in text:
        return SwarmError(f"the libp2p daemon did not start within {timeout_s:.0f}s; "
                          "try again with a larger --startup-timeout (slow disks and busy machines need more)")
    if "none of the initial_peers responded" in text or "bootstrap failed" in text:
        return SwarmError(f"none of the initial peers answered ({', '.join(initial_peers) or 'none given'}); "
                          "check the multiaddrs (including the /p2p/ id), that the peer is up, "
                          "and that its port is reachable from here")
    if "already taken" in text:
        return ConfigError(f"{text}; another process uses this identity file: give each node its own")
    return SwarmError(f"could not start the DHT: {text}")

"""The bootstrap peer: a DHT peer that trains nothing. It gives volunteers an address to
join through, publishes the run spec signed with its identity, checks that it can be
reached where it says, and serves the swarm's status over HTTP from the registry
records every node heartbeats into the DHT."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib import resources
from pathlib import Path

from swarm_bootstrap.known_peers import KnownPeers, peers_file_for
from swarm_bootstrap.view import SwarmView, prometheus_text

from swarm_node import __version__
from swarm_node.data.cache import ShardCache
from swarm_node.data.serve import BudgetConfig, ByteBudget, DataServer
from swarm_node.errors import ConfigError, PeerError, SwarmError, known_failure
from swarm_node.membership.registry import read_registry
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.dialback import address_scope, dial_check, ordered_for_others, serve_dialback
from swarm_node.net.exists import answers_status
from swarm_node.net.guard import PeerGuard
from swarm_node.net.refusals import Refusals
from swarm_node.net.transport import Transport, short_id
from swarm_node.obs.http import Response, StatusServer
from swarm_node.spec import RunSpec
from swarm_node.spec_record import SPEC_REPUBLISH_S, find_run_spec, publish_spec, spec_key
from swarm_node.system import raise_open_file_limit

log = logging.getLogger("swarm_bootstrap")

VERIFY_BATCH = 16  # peers asked for their status at once
VERIFY_TIMEOUT_S = 5.0
REPROBE_MIN_S, REPROBE_MAX_S = 4.0, 60.0  # a peer that did not answer is asked again after this, doubling
REMEMBER_EVERY_S = 10.0  # how often the verified peers' addresses are written down
# A restart dials the peers it wrote down twice, a pause apart: on a loaded host a dial
# that has not answered in 5 s mostly answers then.
REMEMBERED_DIALS = 2
REMEMBERED_REDIAL_PAUSE_S = 3.0


@dataclass(frozen=True)
class BootstrapConfig:
    identity_path: Path
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/31337",)
    announce_maddrs: tuple[str, ...] = ()
    initial_peers: tuple[str, ...] = ()  # other bootstraps or nodes of the same run
    run_spec: RunSpec | None = None  # None: serve the run the initial peers publish
    run_id: str | None = None
    http_host: str = "0.0.0.0"
    http_port: int = 8080
    poll_period_s: float = 2.0
    startup_timeout_s: float = 60.0
    check_reachability: bool = True
    reachability_timeout_s: float = 10.0
    data_dir: Path | None = None  # the run's prepared dataset (data kind manifest), served to volunteers


@dataclass(frozen=True)
class Ready:
    peer_id: str
    maddrs: list[str]
    http_url: str
    run_id: str
    spec_key: str


class BootstrapPeer:
    def __init__(self, config: BootstrapConfig, on_ready: Callable[[Ready], None] = lambda ready: None):
        self.config = config
        self.on_ready = on_ready
        self.dht: SwarmDHT | None = None
        self.spec: RunSpec | None = None
        self.view: SwarmView | None = None
        self.maddrs: list[str] = []
        self.reachability: dict[str, str | None] = {}
        self.transport: Transport | None = None
        self.data_server: DataServer | None = None
        self.data_guard: PeerGuard | None = None
        self._probed: dict[str, tuple[float, float]] = {}  # peer that did not answer -> (ask again at, pause)
        self.known = KnownPeers(peers_file_for(config.identity_path))
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop)
        raise_open_file_limit()
        cfg = self.config
        server = StatusServer(self._routes())
        try:
            self.dht = await SwarmDHT.start(initial_peers=cfg.initial_peers, host_maddrs=cfg.host_maddrs,
                                            announce_maddrs=cfg.announce_maddrs,
                                            identity_path=str(cfg.identity_path),
                                            startup_timeout_s=cfg.startup_timeout_s)
            if self.dht.client_mode:
                raise SwarmError(
                    "the initial peers cannot reach this bootstrap, so it cannot serve volunteers; "
                    "fix the announce address or the firewall (docs/HOSTS.md, 'Ports and addresses')"
                )
            self.spec = await self._resolve_spec()
            # joining nodes ask us to dial them back: can others reach them?
            self.transport = Transport(await self.dht.replicate_p2p())
            await serve_dialback(self.transport, authorize=self.spec.admits)
            await self._serve_data()
            self.view = SwarmView(self.spec.run_id, self.spec.spec_hash(), self.spec.num_stages,
                                  frozenset(self.spec.allowed_peers))
            if not await publish_spec(self.dht, self.spec):
                log.warning("the DHT did not accept the run spec; retrying in the publish loop")
            self.maddrs = ordered_for_others(self.dht.visible_maddrs())
            port = await server.start(cfg.http_host, cfg.http_port)
            self.on_ready(Ready(self.dht.peer_id, self.maddrs, _http_url(cfg.http_host, port),
                                self.spec.run_id,
                                spec_key(self.dht.peer_id)))
            self._advise_on_addresses()
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._publish_loop()), tg.create_task(self._poll_loop()),
                         tg.create_task(self._verify_loop()), tg.create_task(self._watch_dht()),
                         tg.create_task(self._remember_peers())]
                if cfg.check_reachability:
                    tasks.append(tg.create_task(self._check_reachability()))
                await self._stop.wait()
                for task in tasks:
                    task.cancel()
        except BaseExceptionGroup as group:
            known = known_failure(group)
            if known is not None:
                raise known from None
            raise
        finally:
            await server.close()
            if self.dht is not None:
                try:
                    async with asyncio.timeout(15.0):
                        await self.dht.shutdown()
                except TimeoutError:
                    log.warning("gave up stopping the DHT after 15 s")
            log.info("bootstrap stopped")

    async def _resolve_spec(self) -> RunSpec:
        cfg = self.config
        if cfg.run_spec is None and not cfg.initial_peers:
            raise ConfigError(
                "give --run-spec RUN.toml (or --initial-peers of a running bootstrap to serve its run)"
            )
        if not cfg.initial_peers:
            return cfg.run_spec
        # A second bootstrap of a run must publish the very spec the first one does.
        run_id = cfg.run_id or (cfg.run_spec.run_id if cfg.run_spec else None)
        spec, publisher = await find_run_spec(self.dht, cfg.initial_peers, run_id=run_id,
                                              local_spec=cfg.run_spec)
        if publisher is not None:
            log.info("serving run %r as published by %s", spec.run_id, short_id(publisher))
        return spec

    async def _serve_data(self) -> None:
        """The prepared dataset the spec names, from --data: every volunteer's first
        source of the manifest and tokenizer, and of shards no peer holds yet."""
        data, folder = self.spec.data, self.config.data_dir
        if data.kind != "manifest":
            if folder is not None:
                raise ConfigError(
                    f"--data {folder}: the run spec's data is {data.describe()}, not a prepared dataset"
                )
            return
        if folder is None:
            log.warning("the run's data is a prepared dataset but this bootstrap serves none (--data DIR): "
                        "volunteers can fetch it only from peers that already hold it")
            return
        cache = ShardCache(folder, data.manifest_sha256, trust_whole_files=True)
        manifest = await asyncio.to_thread(cache.load_manifest)
        if manifest is None:
            raise ConfigError(f"--data {folder}: its manifest is not the one the run spec names "
                              f"({data.manifest_sha256[:16]}…); prepare it again or fix the spec")
        missing = [e.name for e in manifest.files().values() if not (folder / e.name).is_file()]
        if missing:
            raise ConfigError(
                f"--data {folder} lacks {len(missing)} of the manifest's files ({missing[0]}, ...)"
            )
        self.data_server, self.data_guard = data_service(cache, self.spec, self._verified_live,
                                                         refusals=self.transport.refusals)
        await self.data_server.serve(self.transport, self.data_guard.admit)
        log.info("serving the prepared dataset in %s: %d shards, %.1f M training tokens", folder,
                 len(manifest.train) + len(manifest.val), manifest.train_tokens() / 1e6)

    def _verified_live(self, peer: str) -> bool:
        row = self.view.peers.get(peer) if self.view is not None else None
        return row is not None and row.verified

    # -- loops ---------------------------------------------------------------------
    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(SPEC_REPUBLISH_S * random.uniform(0.8, 1.0))
            try:
                async with asyncio.timeout(10.0):
                    stored = await publish_spec(self.dht, self.spec)
            except TimeoutError:
                stored = False
            if not stored:
                log.warning("re-publishing the run spec failed; trying again in %.0f s", SPEC_REPUBLISH_S)

    async def _poll_loop(self) -> None:
        while True:
            try:
                async with asyncio.timeout(max(5.0, self.config.poll_period_s * 2)):
                    records, unreadable = await read_registry(self.dht, self.spec.run_id,
                                                              self.spec.num_stages,
                                                              self.spec.registry_shards)
                for event in self.view.ingest(time.time(), records, len(unreadable)):
                    log.info("%s", event)
            except TimeoutError:
                log.warning("reading the stage registry timed out")
            await asyncio.sleep(self.config.poll_period_s * random.uniform(0.8, 1.2))

    async def _verify_loop(self) -> None:
        """Ask each listed training peer not yet verified for its status: one that answers
        exists (forged records have nobody behind them) and counts in the swarm's
        figures. At most VERIFY_BATCH at once; a peer that did not answer is asked again
        after a pause that doubles from REPROBE_MIN_S to REPROBE_MAX_S. (Joining peers
        are not asked: they serve nothing yet.)"""
        while True:
            await asyncio.sleep(self.config.poll_period_s * random.uniform(0.8, 1.2))
            now = time.monotonic()
            due = [p for p in self.view.unverified() if self.view.peers[p].record.state == "training"
                   and now >= self._probed.get(p, (0.0, 0.0))[0]]
            random.shuffle(due)
            await asyncio.gather(*(self._verify(peer) for peer in due[:VERIFY_BATCH]))
            listed = set(self.view.peers)
            self._probed = {p: t for p, t in self._probed.items() if p in listed}

    async def _verify(self, peer: str) -> None:
        if await answers_status(self.transport, peer, VERIFY_TIMEOUT_S):
            self.view.mark_verified(peer)
        else:
            _, pause = self._probed.get(peer, (0.0, REPROBE_MIN_S / 2))
            pause = min(REPROBE_MAX_S, pause * 2)
            self._probed[peer] = (time.monotonic() + pause, pause)

    async def _remember_peers(self) -> None:
        """Dial the peers a previous run of this bootstrap knew, so a restart lists the
        swarm within seconds; then keep the list of verified peers up to date."""
        remembered = self.known.load()
        if remembered:
            try:
                reached = 0
                for attempt in range(REMEMBERED_DIALS):
                    if attempt:
                        await asyncio.sleep(REMEMBERED_REDIAL_PAUSE_S)
                    # a peer connected already answers at once: the count is of all reached so far
                    reached = max(reached, await self.dht.rebootstrap(remembered, timeout_s=5.0))
                    if reached >= len(self.known.peers):
                        break
                log.info("dialled %d of the %d peers this bootstrap knew before its restart", reached,
                         len(self.known.peers))
            except PeerError as exc:
                log.warning("could not dial the peers known before the restart: %s", exc)
        while True:
            await asyncio.sleep(REMEMBER_EVERY_S * random.uniform(0.8, 1.2))
            try:
                async with asyncio.timeout(5.0):
                    connected = await self.dht.connected_peers()
            except (TimeoutError, PeerError):
                continue
            self.known.note(connected, verified=[p for p, row in self.view.peers.items() if row.verified])
            await asyncio.to_thread(self.known.save)

    async def _watch_dht(self) -> None:
        while True:
            await asyncio.sleep(2.0)
            if not self.dht.is_alive():
                raise SwarmError(
                    "the DHT process died; restart the bootstrap (same --identity keeps its address)"
                )

    async def _check_reachability(self) -> None:
        checked = [m.rsplit("/p2p/", 1)[0] for m in self.maddrs if address_scope(m) != "unspecified"]
        self.reachability = await dial_check(self.dht.peer_id, checked, self.config.reachability_timeout_s)
        for maddr, problem in self.reachability.items():
            if problem is None:
                log.info("reachability: answered at %s", maddr)
            else:
                port = maddr.rsplit("/", 1)[-1]
                log.warning("reachability: nobody answered at %s (%s). Open TCP port %s in the firewall and "
                            "forward it to this machine on the router. Behind a NAT without hairpinning this "
                            "self-check fails although the port is open: confirm from another network with "
                            "`swarm-node join --initial-peers %s/p2p/%s`", maddr, problem, port, maddr,
                            self.dht.peer_id)

    def _advise_on_addresses(self) -> None:
        scopes = {address_scope(m) for m in self.maddrs}
        if scopes <= {"loopback"}:
            log.warning(
                "this bootstrap announces loopback addresses only: peers on other machines cannot join. "
                "For a public run use --public-ip IP --port PORT (or --host-maddrs /ip4/0.0.0.0/tcp/PORT "
                "--announce-maddrs /ip4/IP/tcp/PORT)"
            )
        elif "public" not in scopes and "dns" not in scopes:
            # an address given on purpose (--public-ip on a LAN, a test bed) needs no advice to give one
            fix = ("if volunteers come from the internet, announce the address it sees instead"
                   if self.config.announce_maddrs else "pass --public-ip for volunteers on the internet")
            log.warning(
                "this bootstrap announces private addresses only (%s): only machines on the same network can "
                "join; %s",
                ", ".join(self.maddrs),
                fix,
            )

    # -- HTTP ------------------------------------------------------------------------
    def _routes(self) -> dict:
        page = resources.files("swarm_bootstrap").joinpath("dashboard.html").read_bytes()
        return {
            "/": lambda: Response(200, page, "text/html; charset=utf-8"),
            "/healthz": self._healthz,
            "/metrics": lambda: self._when_ready(lambda: Response(
                200, prometheus_text(self.view, up=self.dht.is_alive(), peer_id=self.dht.peer_id,
                                     version=__version__, now_s=time.time(),
                                     refusals=self.transport.refusals.as_dict()).encode(),
                "text/plain; version=0.0.4; charset=utf-8")),
            "/api/status": lambda: self._when_ready(lambda: _json(self.status())),
            "/api/history": lambda: self._when_ready(lambda: _json(list(self.view.history))),
        }

    def _when_ready(self, respond: Callable[[], Response]) -> Response:
        if self.view is None:
            return Response(503, b"starting\n")
        return respond()

    def _healthz(self) -> Response:
        if self.dht is not None and self.dht.is_alive() and self.view is not None:
            return Response(200, b"ok\n")
        return Response(503, b"DHT not running\n")

    def status(self) -> dict:
        return {**self.view.status(), "spec_key": spec_key(self.dht.peer_id),
                "spec": self.spec.to_dict(),
                "bootstrap": {"peer_id": self.dht.peer_id, "maddrs": self.maddrs, "version": __version__,
                              "uptime_s": round(time.time() - self.view.started_s, 1),
                              "reachability": self.reachability},
                "data_served_bytes": self.data_server.served_bytes if self.data_server else 0,
                "refusals": self.transport.refusals.as_dict()}


def data_service(cache: ShardCache, spec: RunSpec, verified: Callable[[str], bool],
                 budget: BudgetConfig | None = None,
                 refusals: Refusals | None = None) -> tuple[DataServer, PeerGuard]:
    """The host's dataset service and its gate: a malformed request is a fault of its
    caller (logged once a minute at most; after repeated ones its streams are closed
    unread for a while; counted as "bad-data" in ``refusals``), each caller's answers
    stay within a byte budget, and callers that are not verified live peers share one
    budget, so they cannot crowd those out."""
    guard = PeerGuard(admits=spec.admits, refusals=refusals)
    return DataServer(lambda: cache, on_fault=partial(guard.fault, reason="bad-data"),
                      budget=ByteBudget(budget or BudgetConfig(), verified)), guard


def _json(data) -> Response:
    return Response(200, json.dumps(data, allow_nan=False).encode(), "application/json")


def _http_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{shown}:{port}/"

"""The run spec in the DHT: how a peer publishes it and how a joiner finds, trusts and
checks it.

Each publisher (a bootstrap peer, and every node) stores the spec under
``swarm-node/spec/<its peer id>``, in an entry signed by its identity key. A joiner
reads the keys of the peers it was told to join through and keeps only the entry that
peer signed itself, so what it trains is what the peer in the multiaddr it typed
published, and nobody else can substitute a spec. The record carries the run's
minimum software version apart from the spec, so an old node says "upgrade" instead of
failing to parse a newer spec."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from swarm_node import __version__
from swarm_node.errors import ConfigError, IncompatibleRun, ProtocolError, SwarmError
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.transport import short_id
from swarm_node.spec import RunSpec, version_at_least

log = logging.getLogger(__name__)

SPEC_KEY_PREFIX = "swarm-node/spec/"
SPEC_TTL_S = 3600.0  # a joiner can still read the spec this long after the last publisher is gone
SPEC_REPUBLISH_S = 300.0
MAX_SPEC_JSON_CHARS = 16_384
DEFAULT_FIND_TIMEOUT_S = 20.0


def spec_key(peer_id: str) -> str:
    return f"{SPEC_KEY_PREFIX}{peer_id}"


@dataclass(frozen=True)
class SpecRecord:
    run_id: str
    spec_json: str  # the canonical JSON form, exactly what the hash covers
    spec_hash: str
    min_version: str

    @classmethod
    def of(cls, spec: RunSpec) -> SpecRecord:
        return cls(spec.run_id, spec.canonical_json(), spec.spec_hash(), spec.min_version)

    def to_wire(self) -> dict:
        return {"run_id": self.run_id, "spec": self.spec_json, "spec_hash": self.spec_hash,
                "min_version": self.min_version}

    @classmethod
    def from_wire(cls, raw: object) -> SpecRecord:
        if not isinstance(raw, dict):
            raise ProtocolError("run-spec record is not a map")
        fields = {name: raw.get(key) for name, key in (("run_id", "run_id"), ("spec_json", "spec"),
                                                       ("spec_hash", "spec_hash"),
                                                       ("min_version", "min_version"))}
        for name, value in fields.items():
            limit = MAX_SPEC_JSON_CHARS if name == "spec_json" else 128
            if not isinstance(value, str) or not value or len(value) > limit:
                raise ProtocolError(f"run-spec record has a bad {name}")
        return cls(**fields)

    def parse(self) -> RunSpec:
        """The spec, checked: it must parse with this software version and hash to what
        the publisher announced (a spec from a newer version may not)."""
        require_version(self.run_id, self.min_version)
        try:
            spec = RunSpec.from_dict(json.loads(self.spec_json))
        except (ValueError, RecursionError) as exc:  # ConfigError, bad JSON, a number of over 4,300 digits
            raise IncompatibleRun(
                f"the spec of run {self.run_id!r} does not parse with swarm-node {__version__} "
                f"({exc}); upgrade, or ask the run's host which version it uses"
            ) from None
        if spec.spec_hash() != self.spec_hash:
            raise IncompatibleRun(
                f"the spec of run {self.run_id!r} hashes to {spec.spec_hash()} here but to "
                f"{self.spec_hash} where it was published: the two software versions read it "
                "differently; use the run's version of swarm-node"
            )
        _check_local_paths(spec)
        return spec


def _check_local_paths(spec: RunSpec) -> None:
    """A spec from the network names files this machine reads as training data. Only
    relative paths inside the working directory are allowed, so a hostile spec cannot
    make a node train on (and leak through its activations) files such as ~/.ssh/*."""
    for name in ("path", "tokenizer_path"):
        value = getattr(spec.data, name)
        if value is None:
            continue
        path = PurePosixPath(value)
        if path.is_absolute() or ".." in path.parts or value.startswith("~"):
            raise IncompatibleRun(
                f"the run spec asks for data file {value!r}; a published spec may only name "
                "files relative to the directory you start the node in"
            )


async def publish_spec(dht: SwarmDHT, spec: RunSpec, ttl_s: float = SPEC_TTL_S) -> bool:
    return await dht.store_signed(spec_key(dht.peer_id), SpecRecord.of(spec).to_wire(), ttl_s=ttl_s)


async def read_published(dht: SwarmDHT, peer_id: str) -> SpecRecord | None:
    """The spec ``peer_id`` published, from the entry it signed itself (others are ignored)."""
    entries = await dht.get_signed(spec_key(peer_id))
    if peer_id not in entries:
        return None
    return SpecRecord.from_wire(entries[peer_id].value)


def peer_ids_of(maddrs: Sequence[str]) -> list[str]:
    ids = []
    for maddr in maddrs:
        parts = maddr.rstrip("/").split("/")
        if "p2p" not in parts or parts.index("p2p") + 1 >= len(parts):
            raise ConfigError(f"initial peer {maddr!r} lacks its peer id: copy the whole multiaddr, "
                              "ending in /p2p/<peer id>")
        ids.append(parts[parts.index("p2p") + 1])
    return ids


async def find_run_spec(dht: SwarmDHT, initial_peers: Sequence[str], *, run_id: str | None = None,
                        local_spec: RunSpec | None = None,
                        timeout_s: float = DEFAULT_FIND_TIMEOUT_S) -> tuple[RunSpec, str | None]:
    """The run to join and who published it. With ``local_spec`` (from --config) the
    published spec must match it; without one, the published spec is used."""
    publishers = [p for p in peer_ids_of(initial_peers) if p != dht.peer_id]
    deadline = time.monotonic() + timeout_s
    found: dict[str, SpecRecord] = {}
    while True:
        for peer in publishers:
            try:
                record = await read_published(dht, peer)
            except ProtocolError as exc:
                log.warning("ignoring the run spec published by %s: %s", short_id(peer), exc)
                continue
            if record is not None and (run_id is None or record.run_id == run_id):
                found[peer] = record
        # with a spec at hand one look is enough: initial peers may be plain DHT peers
        if found or not publishers or local_spec is not None or time.monotonic() >= deadline:
            break
        await asyncio.sleep(1.0)  # a bootstrap that just started may not have stored it yet

    if not found:
        if local_spec is not None:
            require_version(local_spec.run_id, local_spec.min_version)
            return local_spec, None
        wanted = f"run {run_id!r}" if run_id else "a run spec"
        raise SwarmError(f"none of the initial peers publishes {wanted} (waited {timeout_s:.0f}s): pass the "
                         "multiaddr of the run's bootstrap peer or of a node of the run, or the spec itself "
                         "with --config RUN_SPEC")
    distinct = {record.spec_hash: (peer, record) for peer, record in found.items()}
    if len(distinct) > 1:
        listing = "; ".join(f"run {r.run_id!r} (spec {h}) from {short_id(p)}" for h, (p,
                                                                                      r) in distinct.items())
        raise ConfigError(f"the initial peers publish different runs: {listing}. Choose one with --run-id, "
                          "or give only the initial peers of the run you mean")
    publisher, record = next(iter(distinct.values()))
    spec = record.parse()
    if local_spec is not None and local_spec.spec_hash() != spec.spec_hash():
        raise IncompatibleRun(
            f"your run spec file has hash {local_spec.spec_hash()} but run {spec.run_id!r} "
            f"(published by {short_id(publisher)}) has {spec.spec_hash()}; leave the file out to "
            "use the published spec, or fix it"
        )
    log.info("joining run %r (spec %s, published by %s)", spec.run_id, spec.spec_hash(), short_id(publisher))
    require_version(spec.run_id, spec.min_version)
    return spec, publisher


def require_version(run_id: str, min_version: str) -> None:
    """Refuse, saying "upgrade", when this software is older than the run needs."""
    if not version_at_least(min_version):
        raise IncompatibleRun(f"run {run_id!r} needs swarm-node >= {min_version}; this is {__version__}: "
                              "upgrade with `pip install -U swarm-node`")

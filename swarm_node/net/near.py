"""Registry reads and heartbeats that go straight to a key's replicas, spread over them.

hivemind's get and store walk towards a key nearest node first, and every find of a
walk is answered with the key's whole dictionary wherever it is held. So the node
nearest each registry key served every fresh read of it and every heartbeat's walk:
with a thousand peers a stage, 20-30 kB/s of control traffic for the peers that
happen to sit nearest a key (the swarm-scale simulator, BENCHMARKS.md), against a few
kB/s for the rest. Here a peer remembers the nodes nearest each key it reads or
writes, learned from the answers themselves (a find names the answering node's
nearest nodes to the key), and

- reads from one of the ``NUM_REPLICAS`` nearest it knows, picked at random, moving
  nearer only when the one asked holds no fresh copy: a warm read is one find, and the
  replicas share the reads;
- stores its heartbeat to the replicas directly, with hivemind's own signing and the
  same store RPC, so a heartbeat downloads no dictionary.

Where the nodes it remembers do not answer, or hold nothing fresh enough, the caller
falls back to hivemind's walk (``None`` from here). Like that walk, a read believes the
nodes an answer names (hivemind's node ids are not bound to anything a reader can
check): a node that names ones that do not exist, or holds nothing, costs a read at most
MAX_FINDS finds before the walk, and the entries it returns are signature-checked. These
functions run inside the DHT process (``DHT.run_coroutine``); what they remember lives
there, per process."""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time

# hivemind 1.1.12's DHTNode defaults, which every DHT of ours runs with: a key lives on
# the NUM_REPLICAS nodes nearest its hash; a get or store walks the DHT (traverse_dht)
# with NUM_WORKERS finds in flight until it has visited the BUCKET_SIZE nearest nodes
# it knows of (its beam), unless a get is satisfied sooner; a find's answer names the
# BUCKET_SIZE nodes nearest the key that the answering node knows. The scale
# simulator's cost model (swarm_node/scale/network.py) follows these.
NUM_REPLICAS, BUCKET_SIZE, NUM_WORKERS = 5, 20, 4
MAX_FINDS = 8  # a read that has not found a fresh copy after this many finds walks instead
RELEARN_S = 300.0  # a writer looks up its key's nearest nodes again this often (peers come and go)
REMEMBERED_KEYS = 4096  # bound on what a DHT process remembers

# key id -> (the nodes nearest it that this process knows, nearest first; when learned)
_nearest: OrderedDict[DHTID, tuple[dict[DHTID, PeerID], float]] = OrderedDict()


def _remember(key_id: DHTID, nodes: dict[DHTID, PeerID], own_id: DHTID) -> None:
    ranked = sorted((n for n in nodes if n != own_id), key=key_id.xor_distance)[:BUCKET_SIZE]
    _nearest[key_id] = ({n: nodes[n] for n in ranked}, get_dht_time())
    _nearest.move_to_end(key_id)
    while len(_nearest) > REMEMBERED_KEYS:
        _nearest.popitem(last=False)


def _forget(key_id: DHTID, node_id: DHTID) -> None:
    if key_id in _nearest:
        _nearest[key_id][0].pop(node_id, None)


def _readable(node: DHTNode, key_id: DHTID, found: ValueWithExpiration) -> ValueWithExpiration:
    """The dictionary as hivemind's get returns it: each entry's signature stripped and its
    value deserialized (the signatures were checked when the find's answer arrived). An
    entry whose bytes do not deserialize is left out: a signature says who wrote it, not
    that it is msgpack, and one such entry must not make the whole key unreadable."""
    protocol, entries = node.protocol, {}
    for subkey, (value_bytes, expires) in found.value.items():
        if protocol.record_validator is not None:
            record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), value_bytes, expires)
            value_bytes = protocol.record_validator.strip_value(record)
        try:
            value = protocol.serializer.loads(value_bytes)
        except Exception:  # msgpack raises many unrelated types for bad bytes (wire/frames.py)
            continue
        entries[subkey] = ValueWithExpiration(value, expires)
    return ValueWithExpiration(entries, found.expiration_time)


async def read_near(_dht, node: DHTNode, key: str,
                    sufficient_expiry: float) -> tuple[ValueWithExpiration | None, int, str | None]:
    """(The key's dictionary, whose newest entry expires at ``sufficient_expiry`` or
    later, or None: walk instead; finds made; the peer id of the node that answered)."""
    key_id = DHTID.generate(source=key)
    held = node.protocol.storage.get(key_id)
    if held is not None and isinstance(held.value,
                                       DictionaryDHTValue) and held.expiration_time >= sufficient_expiry:
        return _readable(node, key_id, held), 0, str(node.peer_id)
    known = dict(_nearest[key_id][0]) if key_id in _nearest else {}
    if len(known) < NUM_REPLICAS:
        known.update(node.protocol.routing_table.get_nearest_neighbors(key_id, BUCKET_SIZE,
                                                                       exclude=node.node_id))
    asked: set[DHTID] = set()
    for finds in range(1, MAX_FINDS + 1):
        pool = sorted((n for n in known if n not in asked), key=key_id.xor_distance)[:NUM_REPLICAS]
        if not pool:
            return None, finds - 1, None
        target = random.choice(pool)  # the replicas share the reads
        asked.add(target)
        known_peer = known[target]
        answer = await node.protocol.call_find(known_peer, [key_id])
        if not answer or key_id not in answer:  # no answer: dead, or unreachable from here
            known.pop(target)
            _forget(key_id, target)
            continue
        found, nearer = answer[key_id]  # the validator has checked every entry's signature
        known.update(nearer)
        known.pop(node.node_id, None)
        _remember(key_id, known, node.node_id)
        if (found is not None and isinstance(found.value, DictionaryDHTValue)
                and found.expiration_time >= sufficient_expiry):
            return _readable(node, key_id, found), finds, str(known_peer)
    return None, MAX_FINDS, None


async def store_near(_dht, node: DHTNode, key: str, subkey, value, expiration: float) -> tuple[bool | None,
                                                                                               int]:
    """(Whether a replica took the entry, None: walk instead; store RPCs sent). The
    entry is signed as hivemind's store signs it and goes to the ``NUM_REPLICAS`` nodes
    nearest the key that this process knows, itself included where it is one of them."""
    key_id = DHTID.generate(source=key)
    remembered = _nearest.get(key_id)
    if remembered is None or get_dht_time() - remembered[1] > RELEARN_S or len(remembered[0]) < NUM_REPLICAS:
        # one walk, a store's: its finds bring the dictionary from the replicas it passes
        found = await node.find_nearest_nodes([key_id], k_nearest=NUM_REPLICAS, beam_size=NUM_REPLICAS,
                                              num_workers=1)
        _remember(key_id, dict(found.get(key_id, {})), node.node_id)
    nodes = _nearest[key_id][0]
    protocol = node.protocol
    value_bytes = protocol.serializer.dumps(value)
    if protocol.record_validator is not None:
        value_bytes = protocol.record_validator.sign_value(
            DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), value_bytes, expiration))
    targets = sorted([*nodes, node.node_id], key=key_id.xor_distance)[:NUM_REPLICAS]
    stored = 0
    if node.node_id in targets:
        targets.remove(node.node_id)
        stored += bool(protocol.storage.store(key_id, value_bytes, expiration, subkey=subkey))
    results = await asyncio.gather(*(protocol.call_store(nodes[t], keys=[key_id], values=[value_bytes],
                                                         expiration_time=[expiration], subkeys=[subkey])
                                     for t in targets))
    for target, result in zip(targets, results):
        if result is None:  # no answer: the next heartbeat goes to the nearest ones left
            _forget(key_id, target)
        elif any(result):
            stored += 1
    return (True if stored else None), len(targets)

"""A hostile DHT peer for tests: it claims a stage-0 volunteer's data slot. It reads the
victim's registry record, then stores a signed stage-0 record (`training`, `data_slot`
= the victim's current slot) under a key whose peer id sorts before the victim's (it
makes RSA keys until one does: a few for a victim whose id sorts late, dozens for one
near the front), and stores it again every few seconds with whatever slot the victim
claims by then. Nothing answers behind the record. A node that believes the claim
leaves its slot, and the next claim follows it; one that went back to a slot's start
would train the same first windows again and again. Prints a JSON line when the first
claim is stored and one each time the claimed slot changes, and a summary at the end.

    python slot_forger.py --initial-peers MADDR --run-id RUN --spec-hash HASH [--victim PEER_ID]"""

from __future__ import annotations

import argparse
import json
import time

from forger import ManyKeys
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm_node import __version__
from swarm_node.errors import ProtocolError
from swarm_node.membership.registry import shard_of, stage_key
from swarm_node.net.identity import peer_id_of_owner
from swarm_node.wire.records import PeerRecord

RECORD_TTL_S = 15.0  # what a node publishes (well under any reader's limit)
MAX_KEYS = 2000  # keys made looking for an id before the victim's


def stage_0(dht: DHT, run_id: str, shards: int) -> dict[str, PeerRecord]:
    """The live stage-0 records, every shard, by the peer id that signed them."""
    records = {}
    for shard in range(shards):
        found = dht.get(stage_key(run_id, 0, shard, shards), latest=True)
        if found is None or not isinstance(found.value, dict):
            continue
        for subkey, entry in found.value.items():
            peer = peer_id_of_owner(subkey)
            if peer is None or not hasattr(entry, "value"):
                continue
            try:
                records[peer] = PeerRecord.from_wire(entry.value)
            except ProtocolError:
                continue
    return records


def claims(dht: DHT, args) -> dict[str, int]:
    """peer -> data slot of the run's training stage-0 peers that claim one."""
    return {peer: r.data_slot for peer, r in stage_0(dht, args.run_id, args.shards).items()
            if r.state == "training" and r.data_slot >= 0 and r.spec_hash == args.spec_hash}


def key_before(victim: str) -> tuple[str, RSAPrivateKey, str, int]:
    """(owner subkey, key, peer id, keys made) for a fresh key whose id sorts before ``victim``."""
    for made in range(1, MAX_KEYS + 1):
        key = RSAPrivateKey()
        marker = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())
        peer = peer_id_of_owner(marker.decode())
        if peer < victim:
            return marker.decode(), key, peer, made
    raise SystemExit(f"no key among {MAX_KEYS} sorts before {victim}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--spec-hash", required=True)
    parser.add_argument("--victim", help="the stage-0 peer id to follow, or its tail as logs show it "
                                         "(default: the one whose id sorts last)")
    parser.add_argument("--shards", type=int, default=1, help="the run spec's registry_shards")
    parser.add_argument("--every-s", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for the victim")
    args = parser.parse_args()
    # Reads go through a DHT that checks and strips signatures as every node's does; the
    # forged record through one that signs with the chosen key (a DHT runs in a child
    # process that takes its validators at start, so it is started once the key is known).
    reader = DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/0.0.0.0/tcp/0"], start=True,
                 record_validators=[RSASignatureValidator()])
    deadline = time.monotonic() + args.wait_s
    while True:
        slots = claims(reader, args)
        named = [peer for peer in slots if peer.endswith(args.victim or "")]
        victim = max(named, default=None)
        if victim is not None:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"no stage-0 record with a data slot {args.victim or ''}")
        time.sleep(1.0)
    marker, key, forged, made = key_before(victim)
    signer = ManyKeys(0)
    signer.keys = {marker.encode(): key}
    writer = DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/0.0.0.0/tcp/0"], start=True,
                 record_validators=[signer])
    key_name = stage_key(args.run_id, 0, shard_of(forged, args.shards), args.shards)
    stores, claimed = 0, []
    until = time.monotonic() + args.seconds
    while time.monotonic() < until:
        slot = slots.get(victim, claimed[-1] if claimed else -1)
        record = PeerRecord(stage=0, spec_hash=args.spec_hash, version=__version__, state="training",
                            data_slot=slot).compact_wire()
        stores += bool(writer.store(key_name, record, get_dht_time() + RECORD_TTL_S, subkey=marker))
        if not claimed or claimed[-1] != slot:
            claimed.append(slot)
            first = {"ready": True, "forger": forged, "victim": victim, "keys_made": made}
            print(json.dumps({**(first if len(claimed) == 1 else {}), "claimed": slot, "stores": stores}),
                  flush=True)
        time.sleep(args.every_s)
        slots = claims(reader, args)
    print(json.dumps({"forger": forged, "victim": victim, "stores": stores, "claimed": claimed}), flush=True)
    writer.shutdown()
    reader.shutdown()


if __name__ == "__main__":
    main()

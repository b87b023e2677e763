"""A hostile DHT peer for tests: it stores registry records for a run's stage, each
signed with a fresh key of its own (so each stands for a peer id nobody runs), claiming
a huge throughput, `seeking`, a tiny loss and a far inner step. Half claim to live an
hour; the other half claim the usual 15 s and are stored again every 5 s, so that they
pass any expiry check and test what nodes do with peers that do not exist.

    python forger.py --initial-peers MADDR --run-id RUN --spec-hash HASH --stage 1 --count 30"""

from __future__ import annotations

import argparse
import json
import time

from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm_node import __version__
from swarm_node.membership.registry import stage_key
from swarm_node.wire.records import PeerRecord


class ManyKeys(RecordValidatorBase):
    """Signs each owner-tagged record with the key its subkey names (hivemind keeps one
    RSASignatureValidator per DHT, so fresh identities need their own signer)."""

    def __init__(self, count: int):
        self.keys = {}
        for _ in range(count):
            key = RSAPrivateKey()
            marker = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_",
                                                                     key.get_public_key().to_bytes())
            self.keys[marker] = key

    def validate(self, record: DHTRecord) -> bool:
        return True  # the RSA validator of every reader checks the signatures

    def sign_value(self, record: DHTRecord) -> bytes:
        key = next((k for marker, k in self.keys.items() if marker in record.subkey), None)  # subkey: msgpack
        if key is None:
            return record.value
        signature = key.sign(RSASignatureValidator()._serialize_record(record))
        return record.value + RSASignatureValidator.SIGNATURE_FORMAT.replace(b"_value_", signature)

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--spec-hash", required=True)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--count", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    signer = ManyKeys(2 * args.count)
    dht = DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/0.0.0.0/tcp/0"], start=True,
              record_validators=[signer])
    record = PeerRecord(stage=args.stage, spec_hash=args.spec_hash, version=__version__, throughput=1e9,
                        seeking=True,
                        loss=0.001, inner_step=10**9, outer_round=10**7, recent_steps=10**6).to_wire()
    markers = [m.decode() for m in signer.keys]
    long_lived, short_lived = markers[:args.count], markers[args.count:]
    key = stage_key(args.run_id, args.stage)
    stored = {"hour": 0, "short": 0}
    for marker in long_lived:
        stored["hour"] += bool(dht.store(key, record, get_dht_time() + 3600, subkey=marker))
    print(json.dumps({"ready": True, **stored}), flush=True)
    until = time.monotonic() + args.seconds
    while time.monotonic() < until:
        for marker in short_lived:
            stored["short"] += bool(dht.store(key, record, get_dht_time() + 15, subkey=marker))
        time.sleep(5)
    print(json.dumps(stored), flush=True)
    dht.shutdown()


if __name__ == "__main__":
    main()

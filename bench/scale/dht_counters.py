"""The byte counters of bench/scale/dht_costs.py: hivemind's unary protobuf calls and
handlers wrapped to add up every DHT RPC's request and response sizes per role and kind.
They are installed in the parent before any DHT process is forked, so they live and fill
in every DHT child, which hands them back through ``child_counters``."""

from __future__ import annotations

from collections import defaultdict

KINDS = ("ping", "store", "store_cache", "find")

_COUNTS: dict[str, int] = defaultdict(int)
_INSTALLED = False


def _kind(handle_name: str, request) -> str:
    name = handle_name.rsplit(".", 1)[-1]
    if name == "rpc_store":
        return "store_cache" if any(request.in_cache) else "store"
    return {"rpc_ping": "ping", "rpc_find": "find"}.get(name, name)


def _add(role: str, kind: str, **fields: int) -> None:
    for field, value in fields.items():
        _COUNTS[f"{role}.{kind}.{field}"] += value


def _find_stats(response) -> dict[str, int]:
    """Values and neighbour lists carried by a FindResponse."""
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.proto import dht_pb2
    from hivemind.utils import MSGPackSerializer

    hit = entries = value_bytes = nbr_bytes = 0
    for result in response.results:
        nbr_bytes += sum(map(len, result.nearest_node_ids)) + sum(map(len, result.nearest_peer_ids))
        if result.type == dht_pb2.FOUND_DICTIONARY:
            hit += 1
            value_bytes += len(result.value)
            value = MSGPackSerializer.loads(result.value)
            entries += len(value) if isinstance(value, DictionaryDHTValue) else 1
        elif result.type == dht_pb2.FOUND_REGULAR:
            hit += 1
            value_bytes += len(result.value)
            entries += 1
    return dict(hit=hit, entries=entries, value_bytes=value_bytes, nbr_bytes=nbr_bytes)


def install_counters() -> None:
    """Wrap hivemind's unary protobuf calls and handlers (before any DHT is forked)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from hivemind.p2p import P2P

    original_call = P2P._call_unary_protobuf_handler
    original_add = P2P._add_protobuf_unary_handler

    async def counted_call(self, peer_id, handle_name, input, output_protobuf_type):
        if not handle_name.startswith("DHTProtocol."):
            return await original_call(self, peer_id, handle_name, input, output_protobuf_type)
        kind = _kind(handle_name, input)
        req = input.ByteSize()
        try:
            response = await original_call(self, peer_id, handle_name, input, output_protobuf_type)
        except BaseException:  # time-out / cancel / error: the request went out (most likely)
            _add("client", kind, calls=1, req=req, fail=1)
            raise
        extra = _find_stats(response) if kind == "find" else {}
        _add("client", kind, calls=1, req=req, resp=response.ByteSize(), **extra)
        return response

    async def counted_add(self, handle_name, handler, input_protobuf_type, balanced=False):
        if handle_name.startswith("DHTProtocol."):
            inner = handler

            async def handler(request, context):
                response = await inner(request, context)
                kind = _kind(handle_name, request)
                extra = _find_stats(response) if kind == "find" and response is not None else {}
                _add("server", kind, calls=1, req=request.ByteSize(),
                     resp=response.ByteSize() if response is not None else 0, **extra)
                return response

        return await original_add(self, handle_name, handler, input_protobuf_type, balanced)

    P2P._call_unary_protobuf_handler = counted_call
    P2P._add_protobuf_unary_handler = counted_add
    _INSTALLED = True


async def child_counters(keys, _dht, node):
    """Runs inside a DHT child: its counters, and what it holds for ``keys``."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue

    held = {}
    for key in keys:
        key_id = DHTID.generate(source=key)
        found = []
        for where in (node.protocol.storage, node.protocol.cache):
            item = where.get(key_id)
            found.append(len(item.value) if item is not None and isinstance(item.value,
                                                                            DictionaryDHTValue) else 0)
        held[key] = found  # [entries in storage, entries in cache]
    return dict(_COUNTS), held, len(node.protocol.routing_table.uid_to_peer_id)

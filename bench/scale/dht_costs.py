"""What the registry's DHT operations cost in bytes on hivemind's DHT, for calibrating
a simulator's cost model.

What it measures. A swarm of P real ``hivemind.DHT`` peers (one forked DHT process and
one p2pd each, started through ``SwarmDHT`` with its own RSA identity and
``RSASignatureValidator``, as nodes do) on loopback. For each record count m, m of the
peers store a signed PeerRecord (msgpack, ~257 bytes) under one key, exactly as the
registry heartbeat does (``store_signed`` -> ``DHT.store(..., subkey="[owner:<key>]")``),
and then, averaged over ``--reps`` repetitions:

* one ``store_signed`` refresh of an existing record: bytes sent+received by the storing
  node and by all the others together, RPCs by kind, replicas written;
* one ``get_signed`` (``DHT.get(key, latest=True)``) returning m entries: how many peers
  answered with the dictionary (responders), bytes the reader received, bytes served by
  the others, RPCs by kind, and what follows by itself (hivemind's ``cache_nearest``
  store, cache refresh gets);
* before that, a few "cold" gets (only the replicas hold the key) and, after a warm-up in
  which every peer reads the key once (the registry's steady state: every node polls it),
  the steady-state figures above;
* per P, the DHT's own background traffic per node per minute when nobody stores or
  reads (m records published with the project's 15 s TTL under a fresh key and read
  twice by everyone first, so hivemind's cache refresh shows up; the time line is in 5 s bins).

How it counts. Exactly, at the RPC level: before the DHT processes are forked, hivemind's
``P2P._call_unary_protobuf_handler`` (every outgoing DHT RPC: ping/store/find) and
``P2P._add_protobuf_unary_handler`` (every incoming one) are wrapped to add up the
protobuf ``ByteSize()`` of each request and response per node, role (client/server) and
kind (ping, store, store_cache = in_cache store, find), plus, for find responses, how
many carried a value, how many dictionary entries, and the bytes of values vs. neighbour
lists. The DHT children inherit the wrappers through fork; the parent reads each child's
counters with ``DHT.run_coroutine``. A measured operation's window runs from just before
the call until the swarm's counters stop changing (background follow-ups included).

What RPC sizes leave out: the unary-call framing between Python and p2pd (unix socket,
not network), and on the wire: p2pd's per-call stream (multistream-select protocol
negotiation with the handler name, a varint length prefix), yamux frame headers
(12 bytes a frame), Noise framing (2-byte length + 16-byte tag a frame), TCP/IP headers
and ACKs, and libp2p's own traffic (identify, ping, keep-alives). To bound that, the
script by default re-runs itself inside a fresh network namespace it creates
(bench/common/sandbox.py; loopback only, root needed) and also reports the namespace's
loopback byte counter for every window ("wire" figures: everything on the wire, TCP/IP
included, counted once). ``--no-sandbox`` skips that.

Run (2 cores: OMP_NUM_THREADS=1, P <= 32):
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.scale.dht_costs --peers 8 16 32 --records 1 8 32 \
        --out /tmp/dht_costs.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from functools import partial

from bench.scale.dht_counters import KINDS, child_counters, install_counters


# --------------------------------------------------------------------------------------
# The swarm (parent side)
# --------------------------------------------------------------------------------------
def wire_bytes() -> int | None:
    """Loopback tx bytes of this network namespace (every packet once)."""
    if not os.environ.get("DHT_COSTS_IN_SANDBOX"):
        return None
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return None


class Swarm:
    def __init__(self, nodes):
        self.nodes = nodes  # SwarmDHT
        self.keys: list[str] = []

    @classmethod
    async def start(cls, peers: int) -> Swarm:
        from swarm_node.net.dht import SwarmDHT

        first = await SwarmDHT.start()
        bootstrap = first.visible_maddrs()
        nodes = [first]
        for _ in range(peers - 1):
            nodes.append(await SwarmDHT.start(initial_peers=bootstrap))
        return cls(nodes)

    async def snapshot(self):
        futures = [n.dht.run_coroutine(partial(child_counters, list(self.keys)), return_future=True)
                   for n in self.nodes]
        return await asyncio.gather(*futures)

    @staticmethod
    def totals(snap) -> int:
        return sum(v for counts, _, _ in snap
                   for k, v in counts.items() if k.endswith(".req") or k.endswith(".resp"))

    async def settle(self, quiet_s: float = 0.35, max_s: float = 4.0):
        """Wait until no DHT RPC moves for ``quiet_s``; returns the last snapshot."""
        deadline = time.monotonic() + max_s
        snap = await self.snapshot()
        while True:
            await asyncio.sleep(quiet_s)
            again = await self.snapshot()
            if self.totals(again) == self.totals(snap) or time.monotonic() > deadline:
                return again
            snap = again

    async def measure(self, operation):
        """Counters of every node over one operation and its follow-ups."""
        before = await self.snapshot()
        wire0 = wire_bytes()
        t0 = time.perf_counter()
        result = await operation()
        op_s = time.perf_counter() - t0
        after = await self.settle()
        wire1 = wire_bytes()
        deltas = [_delta(b[0], a[0]) for b, a in zip(before, after)]
        return result, deltas, after, op_s, (None if wire0 is None else wire1 - wire0)

    async def shutdown(self):
        await asyncio.gather(*(n.shutdown() for n in self.nodes), return_exceptions=True)


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def _get(d: dict, role: str, kind: str, field: str) -> int:
    return d.get(f"{role}.{kind}.{field}", 0)


def _node_bytes(d: dict) -> int:
    """Bytes sent + received by one node (RPC payloads, both roles)."""
    return sum(v for k, v in d.items() if k.endswith(".req") or k.endswith(".resp"))


def _calls(deltas: list[dict], kind: str) -> int:
    return sum(_get(d, "client", kind, "calls") for d in deltas)


def summarize(actor: int, deltas: list[dict], op_s: float, wire: int | None) -> dict:
    me = deltas[actor]
    others = [d for i, d in enumerate(deltas) if i != actor]
    out = {
        "actor_bytes": _node_bytes(me),
        "others_bytes": sum(map(_node_bytes, others)),
        # each RPC byte counted once (client side: request + response)
        "network_bytes": sum(_get(d, "client", k, "req") + _get(d, "client", k,
                                                                "resp") for d in deltas for k in KINDS),
        "actor_rx": sum(_get(me, "client", k, "resp") + _get(me, "server", k, "req") for k in KINDS),
        "actor_tx": sum(_get(me, "client", k, "req") + _get(me, "server", k, "resp") for k in KINDS),
        "served_by_others": sum(_get(d, "server", k, "resp") for d in others for k in KINDS),
        "rpcs": {k: _calls(deltas, k) for k in KINDS},
        "actor_rpcs": {k: _get(me, "client", k, "calls") for k in KINDS},
        "failed_rpcs": sum(_get(d, "client", k, "fail") for d in deltas for k in KINDS),
        # finds issued by the actor that came back with the value (responders)
        "responders": _get(me, "client", "find", "hit"),
        "entries_received": _get(me, "client", "find", "entries"),
        "value_bytes_received": _get(me, "client", "find", "value_bytes"),
        "neighbour_bytes_received": _get(me, "client", "find", "nbr_bytes"),
        # finds by anyone else during the window (cache refresh, follow-ups)
        "other_finds": sum(_get(d, "client", "find", "calls") for d in others),
        "op_ms": op_s * 1e3,
    }
    if wire is not None:
        out["wire_bytes"] = wire
    return out


def mean_of(samples: list[dict]) -> dict:
    out = {}
    for key, value in samples[0].items():
        if isinstance(value, dict):
            out[key] = {k: statistics.fmean(s[key][k] for s in samples) for k in value}
        else:
            out[key] = statistics.fmean(s[key] for s in samples)
    if len(samples) > 1:
        out["actor_bytes_sd"] = statistics.stdev(s["actor_bytes"] for s in samples)
    out["n"] = len(samples)
    return out


def peer_record(i: int, step: int) -> dict:
    from swarm_node.wire.records import PeerRecord

    return PeerRecord(stage=1, spec_hash="3f9a1c0b7d2e4a65", version="0.1.0", state="training",
                      throughput=412.73 + i, queue=3, inner_step=1200 + step, outer_round=24 + step // 50,
                      seeking=False, loss=3.2187, tokens=0, lost=2, partner_rounds=20, local_rounds=4,
                      last_error="", reachable=True, recent_steps=58, recent_microbatches=236).to_wire()


async def measure_key(swarm: Swarm, P: int, m: int, args, rng: random.Random) -> dict:
    from hivemind.utils import MSGPackSerializer

    key = f"bench-dht-costs/P{P}/stage/{m}"
    swarm.keys.append(key)
    nodes = swarm.nodes
    owners = rng.sample(range(P), m)
    step = 0
    # m records, stored at once (like m nodes joining)
    await asyncio.gather(*(nodes[i].store_signed(key, peer_record(i, step), args.ttl) for i in owners))
    snap = await swarm.settle()
    replicas_initial = sum(1 for _, held, _ in snap if held[key][0] == m)

    async def do_get(reader):
        found = await nodes[reader].get_signed(key)
        return len(found)

    async def do_store(owner):
        return await nodes[owner].store_signed(key, peer_record(owner, step), args.ttl)

    # cold: only the replicas (and caches from the stores) hold the key
    cold = []
    candidates = [i for i in range(P) if i not in owners] or list(range(P))
    for reader in rng.sample(candidates, min(args.cold_gets, len(candidates))):
        got, deltas, _, op_s, wire = await swarm.measure(partial(do_get, reader))
        cold.append(dict(summarize(reader, deltas, op_s, wire), entries_returned=got))

    # warm-up: every node reads once (the registry's steady state: everyone polls the key)
    for reader in range(P):
        await nodes[reader].get_signed(key)
    await swarm.settle()

    stores, gets = [], []
    for _ in range(args.reps):
        step += 1
        owner = rng.choice(owners)
        ok, deltas, snap, op_s, wire = await swarm.measure(partial(do_store, owner))
        s = summarize(owner, deltas, op_s, wire)
        s["replicas_written"] = _get(deltas[owner], "client", "store", "calls") - _get(deltas[owner],
                                                                                       "client", "store",
                                                                                       "fail")
        s["stored_ok"] = bool(ok)
        stores.append(s)
        reader = rng.randrange(P)
        got, deltas, snap, op_s, wire = await swarm.measure(partial(do_get, reader))
        g = summarize(reader, deltas, op_s, wire)
        g["entries_returned"] = got
        gets.append(g)
    holders_storage = sum(1 for _, held, _ in snap if held[key][0] > 0)
    holders_cache = sum(1 for _, held, _ in snap if held[key][1] > 0)
    record_bytes = len(MSGPackSerializer.dumps(peer_record(0, 0)))
    store_mean, get_mean = mean_of(stores), mean_of(gets)
    get_mean["entries_returned_min"] = min(g["entries_returned"] for g in gets)
    return {
        "P": P, "m": m, "key": key, "record_msgpack_bytes": record_bytes,
        "replicas_after_initial_store": replicas_initial,
        "nodes_holding_key_in_storage": holders_storage, "nodes_holding_key_in_cache": holders_cache,
        "cold_get": mean_of(cold) if cold else None, "cold_get_samples": cold,
        "store": store_mean, "get": get_mean,
    }


async def measure_idle(swarm: Swarm, P: int, args, rng: random.Random) -> dict:
    """Records published with a short TTL, read twice by all, then nobody acts."""
    # a fresh key: a store with an earlier expiry than the one held is refused
    m = min(max(args.records), P)
    key = f"bench-dht-costs/P{P}/idle/{m}"
    swarm.keys.append(key)
    owners = rng.sample(range(P), m)
    await asyncio.gather(*(swarm.nodes[i].store_signed(key, peer_record(i, 10**6),
                                                       args.idle_ttl) for i in owners))
    # read twice by all (the registry polls): a read served from the node's own cache is
    # what arms hivemind's cache refresh (cache_refresh_before_expiry)
    for _ in range(2):
        for reader in range(P):
            await swarm.nodes[reader].get_signed(key)
    await swarm.settle()
    start = await swarm.snapshot()
    wire0 = wire_bytes()
    t0 = time.monotonic()
    bins = []
    prev, prev_wire = start, wire0
    while time.monotonic() - t0 < args.idle_s:
        await asyncio.sleep(min(args.idle_bin_s, args.idle_s - (time.monotonic() - t0)))
        snap = await swarm.snapshot()
        w = wire_bytes()
        deltas = [_delta(b[0], a[0]) for b, a in zip(prev, snap)]
        bins.append({"t_s": round(time.monotonic() - t0, 1),
                     "rpc_bytes_all_nodes": sum(_get(d, "client", k,
                                                     f) for d in deltas for k in KINDS for f in ("req",
                                                                                                 "resp")),
                     "rpcs": {k: _calls(deltas, k) for k in KINDS},
                     **({} if w is None else {"wire_bytes": w - prev_wire})})
        prev, prev_wire = snap, w
    elapsed_min = (time.monotonic() - t0) / 60
    deltas = [_delta(b[0], a[0]) for b, a in zip(start, prev)]
    per_node = [_node_bytes(d) for d in deltas]
    quiet = [b for b in bins if b["t_s"] > args.idle_ttl + args.idle_bin_s]
    quiet_min = len(quiet) * args.idle_bin_s / 60
    out = {
        "P": P, "m": m, "ttl_s": args.idle_ttl, "window_s": round(elapsed_min * 60, 1),
        "rpc_bytes_per_node_per_min": statistics.fmean(per_node) / elapsed_min,  # sent + received
        "rpc_bytes_per_node_per_min_max": max(per_node) / elapsed_min,
        "rpcs_per_node_per_min": {k: _calls(deltas, k) / P / elapsed_min for k in KINDS},
        "after_expiry_rpc_bytes_per_node_per_min": (
            sum(b["rpc_bytes_all_nodes"] for b in quiet) * 2 / P / quiet_min if quiet else None),
        "bins": bins,
    }
    if wire0 is not None:
        # sent + received per node, like the RPC figures (each wire byte leaves one node, reaches another)
        out["wire_bytes_per_node_per_min"] = 2 * (prev_wire - wire0) / P / elapsed_min
        if quiet:
            out["after_expiry_wire_bytes_per_node_per_min"] = (
                2 * sum(b["wire_bytes"] for b in quiet) / P / quiet_min
            )
    return out


def fits(runs: list[dict]) -> dict:
    """Least-squares fits over every (P, m) of the steady-state means."""
    import numpy as np

    out = {}
    gets = [r["get"] for r in runs]
    # reader received = a * finds + e * (entries received over all responders)
    A = np.array([[g["actor_rpcs"]["find"], g["entries_received"]] for g in gets])
    y = np.array([g["actor_rx"] for g in gets])
    (a, e), *_ = np.linalg.lstsq(A, y, rcond=None)
    out["get_reader_rx"] = {"model": "bytes = per_find * finds + per_entry * (m * responders)",
                            "per_find": float(a), "per_entry": float(e),
                            "max_rel_err": float(np.max(np.abs(A @ [a, e] - y) / y))}
    A = np.array([[g["rpcs"]["find"], g["entries_received"]] for g in gets])
    y = np.array([g["network_bytes"] for g in gets])
    (a2, e2), *_ = np.linalg.lstsq(A, y, rcond=None)
    out["get_network"] = {
        "model": "network bytes (each counted once) = per_find * finds + per_entry * entries_received",
        "per_find": float(a2),
        "per_entry": float(e2),
        "max_rel_err": float(np.max(np.abs(A @ [a2, e2] - y) / y)),
    }
    # value bytes per entry as carried by find responses, exactly
    out["entry_bytes_in_find"] = float(sum(g["value_bytes_received"] for g in gets) /
                                       max(1, sum(g["entries_received"] for g in gets)))
    stores = [r["store"] for r in runs]
    A = np.array([[s["actor_rpcs"]["find"], s["entries_received"], s["replicas_written"]] for s in stores])
    y = np.array([s["actor_bytes"] for s in stores])
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    out["store_actor"] = {
        "model": "storer bytes = per_find * finds + per_entry * entries_received + per_replica * replicas",
        "per_find": float(coef[0]),
        "per_entry": float(coef[1]),
        "per_replica": float(coef[2]),
        "max_rel_err": float(np.max(np.abs(A @ coef - y) / y)),
    }
    # what the wire adds (namespace loopback: TCP/IP, Noise, yamux, multistream, libp2p):
    # wire = rpc payload bytes + per_rpc * rpcs, over every measured window
    windows = [w for r in runs for w in (r["store"], r["get"]) if "wire_bytes" in w]
    if windows:
        A = np.array([[sum(w["rpcs"].values())] for w in windows])
        y = np.array([w["wire_bytes"] - w["network_bytes"] for w in windows])
        (c,), *_ = np.linalg.lstsq(A, y, rcond=None)
        out["wire_overhead"] = {
            "model": "wire bytes = rpc payload bytes + per_rpc * rpcs",
            "per_rpc": float(c),
            "max_rel_err_of_wire": float(
                np.max(np.abs(A[:, 0] * c - y) / np.array([w["wire_bytes"] for w in windows]))
            ),
        }
    return out


def print_table(result: dict) -> None:
    print("\nsteady state (after every node read the key once); bytes = RPC protobuf payloads, mean of reps")
    hdr = (f"{'P':>3} {'m':>3} | {'store: me':>9} {'others':>8} {'finds':>5} {'repl':>4} {'fnd_oth':>7} "
           f"{'wire':>8} | {'get: rx':>8} {'others':>8} {'served':>8} {'resp':>5} {'finds':>5} {'st_c':>4} "
           f"{'wire':>8} | {'cold rx':>8} {'resp':>4}")
    print(hdr)
    print("-" * len(hdr))
    for r in result["runs"]:
        s, g, c = r["store"], r["get"], r["cold_get"] or {}
        print(
            f"{r['P']:>3} {r['m']:>3} | {s['actor_bytes']:>9.0f} {s['others_bytes']:>8.0f} "
            f"{s['rpcs']['find']:>5.1f} "
            f"{s['replicas_written']:>4.1f} {s['other_finds']:>7.1f} "
            f"{s.get('wire_bytes', float('nan')):>8.0f} | "
            f"{g['actor_rx']:>8.0f} {g['others_bytes']:>8.0f} {g['served_by_others']:>8.0f} "
            f"{g['responders']:>5.1f} "
            f"{g['actor_rpcs']['find']:>5.1f} {g['rpcs']['store_cache']:>4.1f} "
            f"{g.get('wire_bytes', float('nan')):>8.0f} | "
            f"{c.get('actor_rx', float('nan')):>8.0f} {c.get('responders', float('nan')):>4.1f}"
        )
    print("\nidle (after one publish with the TTL and two reads by all): per node per minute")
    for i in result["idle"]:
        print(f"P={i['P']:>3} m={i['m']:>3}: rpc {i['rpc_bytes_per_node_per_min']:.0f} B/min "
              f"(after expiry {i['after_expiry_rpc_bytes_per_node_per_min'] or 0:.0f}), "
              f"wire {i.get('wire_bytes_per_node_per_min', float('nan')):.0f} B/min "
              f"(after expiry {i.get('after_expiry_wire_bytes_per_node_per_min', float('nan')):.0f}), "
              f"rpcs/min {json.dumps({k: round(v, 2) for k, v in i['rpcs_per_node_per_min'].items()})}")
    print("\nfits:", json.dumps(result["fits"], indent=1))


async def run(args) -> dict:
    install_counters()
    rng = random.Random(args.seed)
    result = {
        "meta": {
            "peers": args.peers,
            "records": args.records,
            "reps": args.reps,
            "ttl_s": args.ttl,
            "cold_gets": args.cold_gets,
            "idle_s": args.idle_s,
            "idle_ttl_s": args.idle_ttl,
            "wire_counted": wire_bytes() is not None,
            "method": "protobuf ByteSize per DHT RPC",
            "hivemind_defaults": "num_replicas=5 bucket_size=20 beam_size=20 cache_locally=True "
            "cache_nearest=1 cache_on_store=True cache_refresh_before_expiry=5 "
            "refresh_timeout=None",
        },
        "runs": [],
        "idle": [],
        "startup": [],
    }
    for P in args.peers:
        t0 = time.monotonic()
        swarm = await Swarm.start(P)
        try:
            start_s = time.monotonic() - t0
            snap = await swarm.settle()
            result["startup"].append({"P": P, "start_s": start_s,
                                      "routing_table_sizes": sorted(s[2] for s in snap)})
            print(f"P={P}: started in {start_s:.1f}s; routing tables {sorted(s[2] for s in snap)}",
                  flush=True)
            for m in args.records:
                if m > P:
                    continue
                t1 = time.monotonic()
                run_result = await measure_key(swarm, P, m, args, rng)
                result["runs"].append(run_result)
                print(
                    f"  m={m}: {time.monotonic() - t1:.1f}s  store {run_result['store']['actor_bytes']:.0f} "
                    f"B, get rx {run_result['get']['actor_rx']:.0f} B from "
                    f"{run_result['get']['responders']:.1f} responders",
                    flush=True,
                )
            if args.idle_s > 0 and swarm.keys:
                result["idle"].append(await measure_idle(swarm, P, args, rng))
                print(f"  idle: {result['idle'][-1]['rpc_bytes_per_node_per_min']:.0f} B/node/min",
                      flush=True)
        finally:
            await swarm.shutdown()
    if result["runs"]:
        result["fits"] = fits(result["runs"])
    return result


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--records", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--cold-gets", type=int, default=3)
    parser.add_argument("--ttl", type=float, default=300.0,
                        help="TTL of the measured records (long: none expires)")
    parser.add_argument("--idle-s", type=float, default=60.0, help="idle window per P (0: skip)")
    parser.add_argument("--idle-ttl", type=float, default=15.0, help="TTL published before the idle window "
                                                                      "(the project's record_ttl_s)")
    parser.add_argument("--idle-bin-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/dht_costs.json")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="do not re-run inside a private network namespace (no wire byte counts)")
    args = parser.parse_args(argv)
    if max(args.peers) > 32:
        parser.error("keep P <= 32 on this machine (one process and one p2pd per peer)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    if not args.no_sandbox and not os.environ.get("DHT_COSTS_IN_SANDBOX"):
        from bench.common.sandbox import Sandbox

        if Sandbox.available():
            with Sandbox("dhtcost") as sandbox:
                env = dict(os.environ, DHT_COSTS_IN_SANDBOX="1")
                code = subprocess.run(sandbox.command([sys.executable, "-m", "bench.scale.dht_costs", *argv]),
                                      env=env).returncode
            sys.exit(code)
        print("no root / iproute2: counting RPC payloads only (no wire bytes)", file=sys.stderr)

    result = asyncio.run(run(args))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

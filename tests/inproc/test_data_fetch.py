"""Fetching a prepared dataset from peers and mirrors, in process: peers are DataServers
behind a fake transport, mirrors a local HTTP server. Every chunk is checked against the
manifest; a liar is refused, counted and logged once; a restart fetches only what it
lacks; the cache keeps its bound; a full disk keeps what verified."""

from __future__ import annotations

import asyncio
import errno
import functools
import http.server
import logging
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
from data_parts import (
    CHUNK,
    FakeNet,
    answering_status,
    fetcher,
    liar,
    not_ready_at_first,
    prepared_host,
    serving,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm_node.data.cache import ShardCache
from swarm_node.data.fetch import DataFetcher
from swarm_node.data.serve import DataServer
from swarm_node.data.slot_batches import SlotBatches
from swarm_node.errors import DiskFull
from swarm_node.wire.frames import decode_frame, encode_frame


@pytest.fixture(scope="module")
def host_folder(tmp_path_factory):
    return prepared_host(tmp_path_factory)


def test_a_liar_is_refused_once_and_the_shard_still_verifies(tmp_path, host_folder, caplog):
    folder, manifest, digest = host_folder
    net = FakeNet()
    honest = serving(folder, digest)
    net.handlers |= {"QmBoot": honest.handle, "QmLiar": liar(honest),
                     "QmPeer": serving(folder, digest).handle}
    faults = []
    f = fetcher(tmp_path, digest, net, peers=["QmLiar", "QmPeer"], faults=faults)

    async def run():
        await f.fetch_manifest()
        for entry in manifest.train[:3]:
            await f.fetch(entry)

    with caplog.at_level(logging.WARNING):
        asyncio.run(run())
    for entry in manifest.train[:3]:
        assert (tmp_path / "cache" / entry.name).read_bytes() == (folder / entry.name).read_bytes()
    assert f.stats.refused == {"QmLiar"} and faults and all(p == "QmLiar" for p, _ in faults)
    assert (
        len([r for r in caplog.records if "QmLiar"[-6:] in r.getMessage() and "refusing" in r.getMessage()])
        == 1
    )
    liar_chunks = [h for p, h in net.calls if p == "QmLiar" and h["what"] == "chunk"]
    assert len(liar_chunks) <= 4  # asked again after it lied: never
    # peers before the bootstrap: the honest peer served the shards
    assert f.stats.by_source.get("QmPeer", 0) >= sum(e.bytes for e in manifest.train[:3]) - 4 * CHUNK


def test_a_manifest_that_is_not_the_runs_is_refused(tmp_path, host_folder, monkeypatch):
    """The bootstrap is asked first; while it serves nothing yet, a verified peer is asked,
    and the manifest it serves under the run's name but with other bytes is refused."""
    from swarm_node.data import fetch as fetch_module

    monkeypatch.setattr(fetch_module, "RETRY_S", (0.01, 0.02))
    folder, manifest, digest = host_folder
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    (other / "manifest.json").write_bytes((folder / "manifest.json").read_bytes().replace(b'"vocab_size":256',
                                                                                        b'"vocab_size":300'))
    net = FakeNet()
    fake = ShardCache(other, digest, trust_whole_files=True)
    fake.manifest = manifest  # serves under the right name, with other bytes
    boot = serving(folder, digest)
    net.handlers |= {"QmFake": DataServer(lambda: fake, on_fault=lambda p, w: None).handle,
                     "QmBoot": not_ready_at_first(boot)}
    f = fetcher(tmp_path, digest, net, peers=["QmFake"])
    got = asyncio.run(f.fetch_manifest())
    assert got == manifest and f.stats.refused == {"QmFake"}
    assert [p for p, _ in net.calls] == ["QmBoot", "QmFake", "QmBoot"]


def from_the_bootstrap(tmp_path, host_folder) -> tuple[FakeNet, DataFetcher]:
    """A fetcher whose only source is the bootstrap, once it has the manifest."""
    folder, _, digest = host_folder
    net = FakeNet()
    net.handlers["QmBoot"] = serving(folder, digest).handle
    f = fetcher(tmp_path, digest, net)
    asyncio.run(f.fetch_manifest())
    return net, f


def test_a_restart_fetches_only_the_chunks_it_had_not_verified(tmp_path, host_folder):
    folder, manifest, digest = host_folder
    entry = manifest.train[0]
    net, f = from_the_bootstrap(tmp_path, host_folder)
    cache = f.cache
    cache.start_partial(entry)
    have: set[int] = set()
    data = (folder / entry.name).read_bytes()
    for index in range(0, entry.num_chunks(), 2):  # half was fetched before the kill
        start, end = entry.chunk_span(index, CHUNK)
        cache.put_chunk(entry, index, data[start:end], have)
    # a kill in the middle of a write: the last chunk noted is damaged on disk
    damaged = max(have)
    with open(cache.root / f"{entry.name}.part", "r+b") as part:
        part.seek(damaged * CHUNK)
        part.write(b"\0" * 100)
    net.calls.clear()
    again = fetcher(tmp_path, digest, net)
    asyncio.run(again.fetch_manifest())
    asyncio.run(again.fetch(entry))
    asked = sorted(h["chunk"] for _, h in net.calls if h["what"] == "chunk")
    assert asked == sorted(set(range(entry.num_chunks())) - have | {damaged})
    assert (cache.root / entry.name).read_bytes() == data


def test_the_cache_evicts_trained_shards_to_keep_its_bound(tmp_path, host_folder):
    folder, manifest, digest = host_folder
    net = FakeNet()
    net.handlers["QmBoot"] = serving(folder, digest).handle
    budget = 3 * manifest.train[0].bytes + (64 << 10)
    f = fetcher(tmp_path, digest, net, budget=budget)

    async def run():
        await f.fetch_manifest()
        loader = SlotBatches(f, seq_len=64, batch_size=16, seed=0, slot=0, num_slots=1)
        for _ in range(8 * 100_000 // (65 * 16)):  # about eight shards' windows
            await loader.ready()
            loader.next_batch()
            assert f.cache.used_bytes() <= budget
        await loader.close()
        await f.close()
        return loader

    loader = asyncio.run(run())
    assert loader.position.unit >= 5
    small = fetcher(tmp_path / "small", digest, net, budget=manifest.train[0].bytes // 2)
    asyncio.run(small.fetch_manifest())
    with pytest.raises(DiskFull, match="data-cache-gb"):
        asyncio.run(small.fetch(manifest.train[0]))


def test_a_full_disk_keeps_what_verified_and_says_how_much_room_it_needs(tmp_path, host_folder, monkeypatch):
    _, manifest, _ = host_folder
    entry = manifest.train[1]
    _, f = from_the_bootstrap(tmp_path, host_folder)
    writes = []
    real = os.pwrite

    def fills_up(fd, data, offset):
        if len(writes) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        writes.append(offset)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", fills_up)
    with pytest.raises(DiskFull, match=r"disk full .* MB free, the shard needs"):
        asyncio.run(f.fetch(entry))
    monkeypatch.setattr(os, "pwrite", real)
    assert len(f.cache.verified_chunks(entry)) == 3


@pytest.fixture
def mirror(host_folder, tmp_path):
    """The host folder over HTTP (a file server that honours ranges), and an altered
    copy beside it."""
    folder = host_folder[0]
    altered = tmp_path / "altered"
    shutil.copytree(folder, altered)
    for shard in altered.glob("shard-*.tok"):
        data = bytearray(shard.read_bytes())
        data[100] ^= 1
        shard.write_bytes(bytes(data))
    handler = functools.partial(_RangeHandler, directory=str(tmp_path.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    yield base + "/" + folder.name, base + "/" + tmp_path.name + "/altered", folder
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _RangeHandler(_QuietHandler):
    """Answers `Range: bytes=A-B` with 206 and its Content-Range, as mirrors must."""

    def do_GET(self):
        found = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        path = Path(self.translate_path(self.path))
        if found is None or not path.is_file():
            return super().do_GET()
        data = path.read_bytes()
        start, end = int(found.group(1)), min(int(found.group(2)), len(data) - 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        self.wfile.write(data[start:end + 1])


def test_mirrors_are_tried_after_peers_and_a_lying_mirror_is_refused(tmp_path, host_folder, mirror):
    good_url, bad_url, folder = mirror
    _, manifest, digest = host_folder
    net = FakeNet()
    net.handlers["QmBoot"] = serving(folder, digest).handle
    f = fetcher(tmp_path, digest, net, private_mirrors=True)  # the test's mirror is on loopback
    asyncio.run(f.fetch_manifest())
    # The mirrors are those of the manifest; point them at the test server (same files).
    object.__setattr__(f.cache.manifest, "sources", (bad_url, good_url))
    net.handlers.clear()  # no peer holds anything now: the mirrors are all there is
    asyncio.run(f.fetch(manifest.train[2]))
    assert (f.cache.root / manifest.train[2].name).read_bytes() == (
        folder / manifest.train[2].name
    ).read_bytes()
    assert f.stats.refused == {bad_url} and f.stats.by_source[good_url] > 0


def test_two_stage_0_nodes_that_join_together_train_disjoint_shards(tmp_path, host_folder):
    """RunData as the node wires it: both fetch the manifest from the bootstrap, claim
    the same slot at once, and the one with the larger id moves on its next look."""
    from swarm_node.data.source import RunData
    from swarm_node.data.spec import DataSpec
    from swarm_node.spec import RunSpec

    folder, manifest, digest = host_folder
    spec = RunSpec(seq_len=64, batch_size=8, data=DataSpec(kind="manifest", manifest_sha256=digest, slots=2))
    net = FakeNet()
    net.handlers["QmBoot"] = serving(folder, digest).handle
    claims: dict[str, int] = {}
    nodes = {peer: RunData(spec, cache_dir=tmp_path / peer, cache_gb=None, initial_peers=["QmBoot"],
                           peers=list, on_fault=lambda p, w: None, progress=False) for peer in ("QmA", "QmB")}
    net.handlers |= {peer: answering_status for peer in nodes}  # both run: their claims are believed

    async def run():
        for peer, data in nodes.items():
            assert await data.open(net, asyncio.to_thread) == manifest.vocab_size
            data.open_loader(peer_id=peer, batch_size=8, shard=(0, 1), resumed=None,
                             claims=lambda: dict(claims))
        assert [d.claimed_slot() for d in nodes.values()] == [0, 0]  # neither saw the other's claim yet
        claims.update({peer: data.claimed_slot() for peer, data in nodes.items()})  # the next registry read
        for data in nodes.values():
            await data.settle_slot(0.0)
        for _ in range(60):
            for data in nodes.values():
                await data.loader.ready()
                data.loader.next_batch()
        for data in nodes.values():
            await data.close()

    asyncio.run(run())
    assert [d.claimed_slot() for d in nodes.values()] == [0, 1]
    trained = [set(d.trained_shards) for d in nodes.values()]
    assert trained[0] and trained[1] and not trained[0] & trained[1]
    assert all(d.status()["fetched_bytes"] > 0 for d in nodes.values())


def test_a_checkpoint_s_data_position_gives_the_loader_its_slot_or_shard_back(tmp_path, host_folder):
    """A stage-0 checkpoint keeps the slot it trained (or its shard of in-memory windows)
    under "shard", one layout for both loaders: reopened with it, the loader takes that
    slot back and goes on where it was, and the position it writes is the one it read."""
    from types import SimpleNamespace

    from swarm_node.data.dataset import load_windows
    from swarm_node.data.slot_batches import SlotPosition
    from swarm_node.data.source import RunData
    from swarm_node.data.spec import DataSpec
    from swarm_node.spec import RunSpec
    from swarm_node.train.pipeline import Pipeline

    folder, _, digest = host_folder
    spec = RunSpec(seq_len=64, batch_size=8, data=DataSpec(kind="manifest", manifest_sha256=digest, slots=4))
    net = FakeNet()
    net.handlers["QmBoot"] = serving(folder, digest).handle
    saved = {"shard": [2, 4], "pass": 0, "unit": 1, "offset": 8}

    async def reopen():
        data = RunData(spec, cache_dir=tmp_path, cache_gb=None, initial_peers=["QmBoot"], peers=list,
                       on_fault=lambda p, w: None, progress=False)
        await data.open(net, asyncio.to_thread)
        loader = data.open_loader(peer_id="QmSelf", batch_size=8, shard=(0, 1), resumed=saved, claims=dict)
        await data.close()
        return data, loader

    data, loader = asyncio.run(reopen())
    assert (loader.slot, loader.num_slots, data.claimed_slot()) == (2, 4, 2)
    assert loader.position == SlotPosition(data_pass=0, unit=1, offset=8)
    assert Pipeline.data_position(SimpleNamespace(loader=loader)) == saved

    synthetic = RunSpec(seq_len=16, batch_size=4, data=DataSpec(kind="synthetic", num_tokens=20_000))
    in_memory = RunData.in_memory(synthetic, load_windows(synthetic.data, synthetic.seq_len))
    saved = {"shard": [3, 8], "epoch": 2, "offset": 12}
    loader = in_memory.open_loader(peer_id="QmSelf", batch_size=4, shard=(3, 8), resumed=saved, claims=dict)
    assert (loader.shard_id, loader.num_shards, in_memory.claimed_slot()) == (3, 8, -1)
    assert Pipeline.data_position(SimpleNamespace(loader=loader)) == saved


def test_nobody_serving_the_manifest_ends_in_one_line_that_says_what_to_do(tmp_path, host_folder,
                                                                           monkeypatch):
    from swarm_node.data import fetch as fetch_module
    from swarm_node.errors import DataError

    monkeypatch.setattr(fetch_module, "RETRY_S", (0.01, 0.02))
    f = fetcher(tmp_path, host_folder[2], FakeNet())  # the bootstrap is not there
    with pytest.raises(DataError, match="swarm-bootstrap --data DIR"):
        asyncio.run(f.fetch_manifest(timeout_s=0.1))


@given(header=st.dictionaries(st.sampled_from(["kind", "manifest", "what", "name", "chunk", "extra"]),
                              st.one_of(st.none(), st.integers(-2**62, 2**62), st.text(max_size=70),
                                        st.sampled_from(["data", "chunk", "have", "manifest",
                                                         "shard-00000.tok",
                                                         "digest"]),
                                        st.lists(st.integers(-2**62, 2**62), max_size=3)), max_size=6))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_request_gets_a_frame_back_and_bad_ones_count_against_the_caller(host_folder, header):
    folder, _, digest = host_folder
    cache = ShardCache(folder, digest, trust_whole_files=True)
    cache.load_manifest()
    faults = []
    server = DataServer(lambda: cache, on_fault=lambda peer, why: faults.append(peer))
    if header.get("manifest") == "digest":
        header["manifest"] = digest
    answer, _ = decode_frame(asyncio.run(server.handle("QmCaller", encode_frame(header))))
    assert isinstance(answer.get("ok"), bool)
    if not answer["ok"] and answer.get("error") == "protocol":
        assert faults == ["QmCaller"]


@given(answer=st.binary(max_size=300))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_source_answering_garbage_is_refused_not_a_crash(tmp_path_factory, host_folder, answer):
    folder, manifest, digest = host_folder
    net = FakeNet()

    async def garbage(remote, request):
        return answer

    net.handlers |= {"QmGarbage": garbage, "QmBoot": serving(folder, digest).handle}
    f = fetcher(tmp_path_factory.mktemp("garbage"), digest, net, peers=["QmGarbage"])
    asyncio.run(f.fetch_manifest())
    asyncio.run(f.fetch(manifest.train[0]))
    assert f.cache.has(manifest.train[0])


def test_shards_too_small_for_a_batch_end_in_one_line_not_a_spin(tmp_path, host_folder):
    from swarm_node.errors import DataError

    _, f = from_the_bootstrap(tmp_path, host_folder)
    loader = SlotBatches(f, seq_len=64, batch_size=4096, seed=0, slot=0, num_slots=2)

    async def run():
        try:
            await loader.ready()
        finally:
            await loader.close()
            await f.close()

    with pytest.raises(DataError, match="larger --shard-tokens"):
        asyncio.run(run())

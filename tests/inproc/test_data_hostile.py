"""Hostile and broken sources of a prepared dataset, in process (the security review of
the data path): a holder that claims every file and then fails every chunk (not held,
busy, oversized, stalling, bfloat16) starves no fetch and is refused or dropped as the
rule says; a dataset of thousands of files is fetched; peers nobody verified hold up
neither the manifest nor the holdings; one damaged file of the host costs that file
only; the fetcher's tables stay bounded."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
import torch
import vclock
from data_parts import (
    CHUNK,
    FakeNet,
    claims_everything,
    fetcher,
    liar,
    not_ready_at_first,
    prepared_host,
    serving,
)

from swarm_node.data import fetch as fetch_module
from swarm_node.data import holders as holders_module
from swarm_node.data import sources as sources_module
from swarm_node.data.manifest import MANIFEST_FILE, Manifest, file_entry
from swarm_node.data.serve import bytes_frame
from swarm_node.data.shard_format import shard_bytes
from swarm_node.wire.frames import encode_frame


@pytest.fixture(scope="module")
def host_folder(tmp_path_factory):
    return prepared_host(tmp_path_factory)


def _refusals(caplog, peer: str) -> int:
    return len([r for r in caplog.records if "refusing" in r.getMessage() and peer[-6:] in r.getMessage()])


def _chunk_calls(net: FakeNet, peer: str) -> int:
    return len([h for p, h in net.calls if p == peer and h["what"] == "chunk"])


async def _not_held(remote, request):
    return encode_frame({"ok": False, "error": "not held"})


async def _busy(remote, request):
    return encode_frame({"ok": False, "error": "busy"})


async def _oversized(remote, request):
    return b"\0" * (CHUNK + 8192)


@pytest.mark.parametrize(("answer", "refused"), [(_not_held, True), (_busy, False), (_oversized, True)],
                         ids=["not-held", "busy", "oversized"])
def test_a_holder_that_claims_every_file_and_serves_none_starves_no_fetch(tmp_path, host_folder, caplog,
                                                                          answer, refused):
    """The host stays a source whatever others claim: each file comes from it once the
    claimant let it down; a liar is refused for the run after its strikes (an oversized
    answer at once) and logged once; "busy" is no lie."""
    folder, manifest, digest = host_folder
    net = FakeNet()
    honest = serving(folder, digest)
    net.handlers |= {"QmBoot": honest.handle, "QmStealth": claims_everything(honest, answer)}
    faults = []
    f = fetcher(tmp_path, digest, net, peers=["QmStealth"], faults=faults)

    async def run():
        await f.fetch_manifest()
        for entry in manifest.train[:sources_module.MAX_STRIKES]:
            await asyncio.wait_for(f.fetch(entry), 10)

    with caplog.at_level(logging.INFO):
        asyncio.run(run())
    for entry in manifest.train[:sources_module.MAX_STRIKES]:
        assert (tmp_path / "cache" / entry.name).read_bytes() == (folder / entry.name).read_bytes()
    assert _chunk_calls(net, "QmBoot") > 0
    assert _chunk_calls(net, "QmStealth") <= sources_module.MAX_STRIKES  # one chunk per file at most
    assert f.stats.refused == ({"QmStealth"} if refused else set())
    assert _refusals(caplog, "QmStealth") == (1 if refused else 0)
    assert all(p == "QmStealth" for p, _ in faults) and bool(faults) == refused


def test_a_holder_that_stalls_holds_up_each_file_for_seconds_then_is_refused(tmp_path, host_folder, caplog):
    """A claimant that never answers: once no chunk has come for HEDGE_S the host joins
    the file and takes the stalled chunk too; after MAX_STRIKES stalls it is refused."""
    folder, manifest, digest = host_folder
    net = FakeNet()
    honest = serving(folder, digest)

    async def stall(remote, request):
        await asyncio.sleep(3600)

    net.handlers |= {"QmBoot": honest.handle, "QmStealth": claims_everything(honest, stall)}
    f = fetcher(tmp_path, digest, net, peers=["QmStealth"])
    strikes = sources_module.MAX_STRIKES

    async def run():
        await f.fetch_manifest()
        started = asyncio.get_running_loop().time()
        for entry in manifest.train[:strikes + 1]:
            await asyncio.wait_for(f.fetch(entry), 300)
        return asyncio.get_running_loop().time() - started

    with caplog.at_level(logging.INFO):
        took = vclock.run(run())
    assert took < strikes * (fetch_module.HEDGE_S + holders_module.HAVE_WAIT_S) + 10  # virtual seconds
    for entry in manifest.train[:strikes + 1]:
        assert (tmp_path / "cache" / entry.name).read_bytes() == (folder / entry.name).read_bytes()
    assert f.stats.refused == {"QmStealth"} and _refusals(caplog, "QmStealth") == 1
    assert _chunk_calls(net, "QmStealth") == strikes  # never asked again once refused


def _bf16_answer():
    async def answer(remote, request):
        return encode_frame({"ok": True}, [torch.zeros(64, dtype=torch.bfloat16)])
    return answer


def test_a_bfloat16_data_answer_is_refused_not_a_crash(tmp_path, host_folder, monkeypatch):
    """torch has no numpy bfloat16 (``.numpy()`` raises TypeError): the answer's dtype is
    checked, the peer refused and counted, and the host serves the manifest and file."""
    monkeypatch.setattr(fetch_module, "RETRY_S", (0.01, 0.02))
    folder, manifest, digest = host_folder
    net = FakeNet()
    boot = serving(folder, digest)
    net.handlers |= {"QmBoot": not_ready_at_first(boot), "QmBf16": _bf16_answer()}
    faults = []
    f = fetcher(tmp_path, digest, net, peers=["QmBf16"], faults=faults)
    assert asyncio.run(f.fetch_manifest()) == manifest
    assert f.stats.refused == {"QmBf16"} and faults and faults[0][0] == "QmBf16"

    again = fetcher(tmp_path / "again", digest, net, peers=["QmBf16"])
    net.handlers["QmBf16"] = claims_everything(boot, _bf16_answer())

    async def run():
        await again.fetch_manifest()
        await asyncio.wait_for(again.fetch(manifest.train[0]), 10)

    asyncio.run(run())
    assert again.cache.has(manifest.train[0]) and again.stats.refused == {"QmBf16"}


@pytest.fixture(scope="module")
def many_files(tmp_path_factory):
    """4,200 small shards and a validation shard: a `have` answer listing their names
    would be over 64 KiB."""
    folder = tmp_path_factory.mktemp("many")
    tokens = np.arange(1024) % 256
    data = shard_bytes(tokens, 256)
    entries = []
    for i in range(4201):
        name = f"shard-{i:05d}.tok"
        (folder / name).write_bytes(data)
        entries.append(file_entry(name, data, 4096, tokens=len(tokens)))
    manifest = Manifest(vocab_size=256, dtype="u16", chunk_bytes=4096, tokenizer=None,
                        train=tuple(entries[:-1]),
                        val=(entries[-1],))
    (folder / MANIFEST_FILE).write_bytes(manifest.to_bytes())
    return folder, manifest, manifest.sha256()


def test_a_dataset_of_thousands_of_files_is_fetched(tmp_path, many_files):
    folder, manifest, digest = many_files
    net = FakeNet()
    net.handlers["QmBoot"] = serving(folder, digest).handle
    f = fetcher(tmp_path, digest, net)

    async def run():
        await f.fetch_manifest()
        await asyncio.wait_for(f.fetch(manifest.train[0]), 10)
        await asyncio.wait_for(f.fetch(manifest.train[-1]), 10)

    asyncio.run(run())
    assert f.stats.refused == set()
    assert f.cache.has(manifest.train[0]) and f.cache.has(manifest.train[-1])


def test_the_largest_holdings_answer_fits_what_the_fetcher_accepts():
    """MAX_SHARDS is what the protocol carries: a `have` answer for that many files is
    within the fetcher's cap for it."""
    from swarm_node.data.manifest import MAX_SHARDS
    from swarm_node.wire.frames import FrameLimits, decode_frame

    answer = bytes_frame({"ok": True, "count": MAX_SHARDS}, b"\xff" * (MAX_SHARDS // 8))
    assert len(answer) <= holders_module.HAVE_BYTES
    decode_frame(answer, FrameLimits(max_payload_bytes=holders_module.HAVE_BYTES, max_tensors=1))


def test_peers_nobody_verified_hold_up_neither_the_manifest_nor_the_holdings(tmp_path, host_folder):
    """Ten live peers whose calls stall: the manifest comes from the bootstrap at once,
    and a round of holdings questions asks one of them and waits HAVE_WAIT_S at most."""
    folder, manifest, digest = host_folder
    net = FakeNet()

    async def stall(remote, request):
        await asyncio.sleep(3600)

    slow = [f"QmSlow{i}" for i in range(10)]
    net.handlers |= {peer: stall for peer in slow} | {"QmBoot": serving(folder, digest).handle}
    f = fetcher(tmp_path, digest, net, peers=slow, timeout_s=1.0)

    async def run():
        clock = asyncio.get_running_loop()
        started = clock.time()
        await f.fetch_manifest()
        manifest_s = clock.time() - started
        started = clock.time()
        await f.fetch(manifest.train[0])
        return manifest_s, clock.time() - started

    manifest_s, shard_s = vclock.run(run())
    assert manifest_s < 1.0 and not [p for p, h in net.calls if p in slow and h["what"] == "manifest"]
    assert shard_s <= holders_module.HAVE_WAIT_S + 1.0
    assert len([p for p, h in net.calls if p in slow and h["what"] == "have"]) <= holders_module.MAX_PROBES


def test_one_damaged_file_of_the_host_costs_that_file_only(tmp_path, host_folder, caplog):
    """The host hashes each file at its first serve: a damaged one is not served (logged
    once), the others are, and the fetcher refuses the host for nothing. A host that
    sends wrong bytes of one file is dropped for that file only."""
    import shutil

    folder, manifest, digest = host_folder
    damaged = tmp_path / "host"
    shutil.copytree(folder, damaged)
    bad = manifest.train[1]
    data = bytearray((damaged / bad.name).read_bytes())
    data[100] ^= 1
    (damaged / bad.name).write_bytes(bytes(data))
    net = FakeNet()
    host = serving(damaged, digest)
    net.handlers["QmBoot"] = host.handle
    f = fetcher(tmp_path, digest, net)

    async def run():
        await f.fetch_manifest()
        with pytest.raises(TimeoutError):  # no honest source of it: it waits for one
            await asyncio.wait_for(f.fetch(bad), 30)
        await asyncio.wait_for(f.fetch(manifest.train[0]), 30)

    with caplog.at_level(logging.WARNING):
        vclock.run(run())
    assert f.cache.has(manifest.train[0]) and "QmBoot" not in f.stats.refused
    assert bad.name not in host.cache().whole_files()
    assert (
        len([r for r in caplog.records if "differs from the manifest: not serving it" in r.getMessage()]) == 1
    )

    # a host that sends wrong bytes of one file
    lying = liar(serving(folder, digest))
    honest = serving(folder, digest)

    async def lies_about_one(remote, request):
        from swarm_node.wire.frames import decode_frame

        header = decode_frame(request)[0]
        return await (lying if header.get("name") == bad.name else honest.handle)(remote, request)

    net.handlers["QmBoot"] = lies_about_one
    g = fetcher(tmp_path / "g", digest, net)

    async def again():
        await g.fetch_manifest()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(g.fetch(bad), 30)
        await asyncio.wait_for(g.fetch(manifest.train[2]), 30)

    vclock.run(again())
    assert g.cache.has(manifest.train[2]) and "QmBoot" not in g.stats.refused


def test_the_fetchers_tables_stay_bounded_whatever_number_of_peers(tmp_path, host_folder, monkeypatch):
    monkeypatch.setattr(sources_module, "MAX_TRACKED", 8)
    monkeypatch.setattr(sources_module, "MAX_BY_SOURCE", 4)
    monkeypatch.setattr(holders_module, "MAX_HOLDINGS", 8)
    folder, manifest, digest = host_folder
    net = FakeNet()
    honest = serving(folder, digest)
    peers = [f"QmP{i}" for i in range(40)]

    async def garbage(remote, request):
        return b"\x01garbage"

    net.handlers |= {p: garbage for p in peers[:20]} | {p: honest.handle for p in peers[20:]}
    net.handlers["QmBoot"] = honest.handle
    f = fetcher(tmp_path, digest, net, peers=peers, verified=lambda peer: True)

    async def run():
        await f.fetch_manifest()
        for entry in manifest.train[:3]:
            await f.fetch(entry)
        await f.holders.refresh()

    asyncio.run(run())
    assert len(f.stats.refused) <= 8 and len(f.holders.holdings) <= 8
    assert len(f.stats.by_source) <= 5  # four sources apart and "others"
    book = f.book
    for i in range(100):  # a flood of let-downs and refusals
        book.clock = lambda: 0.0
        book.let_down(f"QmX{i}", "shard-00000.tok", "stalled")
        book.refuse(f"QmY{i}", "lied")
    assert len(book._dropped) <= 8 and len(book._strikes) <= 8 and len(book.stats.refused) <= 8


def test_the_hosts_data_service_counts_bad_requests_and_serves_verified_peers_first(host_folder, caplog):
    """The bootstrap's data service: a flood of malformed requests is logged once and
    ends with the caller's streams closed; fresh identities together exhaust one shared
    budget ("busy", no fault), while a verified live peer is still served."""
    from swarm_bootstrap.peer import data_service

    from swarm_node.data.cache import ShardCache
    from swarm_node.data.serve import BudgetConfig, data_request
    from swarm_node.data.spec import DataSpec
    from swarm_node.spec import RunSpec
    from swarm_node.wire.frames import decode_frame

    folder, manifest, digest = host_folder
    cache = ShardCache(folder, digest, trust_whole_files=True)
    cache.load_manifest()
    spec = RunSpec(seq_len=64, batch_size=8, data=DataSpec(kind="manifest", manifest_sha256=digest, slots=2))
    budget = BudgetConfig(rate_bytes_s=1024, unverified_rate_bytes_s=1024, unverified_total_bytes_s=1024,
                          # 60 KiB a bucket, refilled at 1 KiB/s: the test's seconds refill little
                          burst_s=60)
    server, guard = data_service(cache, spec, lambda peer: peer == "QmVerified", budget)

    def ask(peer: str, request: bytes) -> dict:
        return decode_frame(asyncio.run(server.handle(peer, request)))[0]

    with caplog.at_level(logging.INFO):
        for _ in range(20):
            assert ask("QmBad", encode_frame({"kind": "data", "what": "nonsense"}))["error"] == "protocol"
    assert not guard.admit("QmBad") and guard.admit("QmFresh0") and guard.admit("QmVerified")
    assert len([r for r in caplog.records if "QmBad"[-6:] in r.getMessage()]) <= 2  # ignoring, banning

    chunk = data_request(digest, "chunk", manifest.train[0].name, 0)
    answers = [ask(f"QmFresh{i}", chunk) for i in range(12)]  # 16 KiB each: four drain the shared 60 KiB
    assert [a["ok"] for a in answers[:4]] == [True] * 4
    assert all(not a["ok"] and a["error"] == "busy" for a in answers[4:])
    assert ask("QmVerified", chunk)["ok"] and guard.faults("QmFresh5") == 0

"""The data cache on the disk of a machine (the security review of the data path): nodes
of one machine share it without tripping on each other, its bound survives a restart,
links and folders planted by another user are not followed or used, and what the disk
refuses ends in one line."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time

import pytest
from data_parts import FakeNet, fetcher, prepared_host, serving

from swarm_node.data import cache as cache_module
from swarm_node.data import fetch as fetch_module
from swarm_node.errors import DataError, DiskFull


@pytest.fixture(scope="module")
def host_folder(tmp_path_factory):
    return prepared_host(tmp_path_factory)


def test_nodes_of_one_machine_sharing_one_cache_start_together_without_an_error(tmp_path, host_folder,
                                                                                  monkeypatch):
    """Four nodes (threads, each its own loop and fetcher) on one cache, let go at once
    by a barrier: the manifest and two shards, 20 times over; no error, the files whole."""
    monkeypatch.setattr(fetch_module, "LOCK_POLL_S", 0.01)
    folder, manifest, digest = host_folder
    wanted = manifest.train[:2]
    failures = []
    for rep in range(20):
        shared = tmp_path / f"rep{rep}"
        barrier = threading.Barrier(4)

        def node(number: int, shared=shared, barrier=barrier, rep=rep) -> None:
            net = FakeNet()
            net.handlers["QmBoot"] = serving(folder, digest).handle
            f = fetcher(shared, digest, net)

            async def start():
                barrier.wait()
                await f.fetch_manifest()
                for entry in wanted:
                    await f.fetch(entry)

            try:
                asyncio.run(start())
            except Exception as exc:  # what the test counts
                failures.append((rep, number, repr(exc)))

        threads = [threading.Thread(target=node, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for entry in wanted:
            assert (shared / "cache" / entry.name).read_bytes() == (folder / entry.name).read_bytes()
    assert failures == []


def test_the_cache_bound_survives_a_restart(tmp_path, host_folder):
    """After a restart the shards in the cache are no longer this process's: those not
    about to be trained are evicted, oldest first, instead of the cache being full for good."""
    folder, manifest, digest = host_folder
    net = FakeNet()
    net.handlers["QmBoot"] = serving(folder, digest).handle
    budget = 3 * manifest.train[0].bytes + (64 << 10)
    first = fetcher(tmp_path, digest, net, budget=budget)

    async def fill():
        await first.fetch_manifest()
        for entry in manifest.train[:3]:
            await first.fetch(entry)

    asyncio.run(fill())
    for age, entry in enumerate(manifest.train[:3]):  # shard 0 the oldest
        os.utime(tmp_path / "cache" / entry.name, (time.time() - 1000 + age, time.time() - 1000 + age))
    restarted = fetcher(tmp_path, digest, net, budget=budget)

    async def go_on():
        await restarted.fetch_manifest()
        await restarted.fetch(manifest.train[3])

    asyncio.run(go_on())
    cached = {p.name for p in (tmp_path / "cache").glob("*.tok")}
    assert cached == {e.name for e in manifest.train[1:4]}
    assert restarted.cache.used_bytes() <= budget


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder another user owns")
def test_a_cache_folder_another_user_owns_is_refused(tmp_path, host_folder):
    folder, _, digest = host_folder
    planted = tmp_path / "cache"
    planted.mkdir()
    os.chown(planted, 65534, 65534)  # nobody's, as if another user had made it first
    net = FakeNet()
    net.handlers["QmBoot"] = serving(folder, digest).handle
    f = fetcher(tmp_path, digest, net)
    with pytest.raises(DataError, match="belongs to another user"):
        asyncio.run(f.fetch_manifest())
    assert list(planted.iterdir()) == []


def test_links_planted_in_the_cache_are_not_followed(tmp_path, host_folder):
    folder, manifest, digest = host_folder
    entry = manifest.train[0]
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    victims = {}
    for name in (f"{entry.name}.part", f"{entry.name}.have.tmp", "manifest.json.tmp"):
        victim = tmp_path / f"victim-{name}"
        victim.write_bytes(b"precious")
        (root / name).symlink_to(victim)
        victims[name] = victim
    net = FakeNet()
    net.handlers["QmBoot"] = serving(folder, digest).handle
    f = fetcher(tmp_path, digest, net)

    async def run():
        await f.fetch_manifest()
        await f.fetch(entry)

    asyncio.run(run())
    assert (root / entry.name).read_bytes() == (folder / entry.name).read_bytes()
    for victim in victims.values():
        assert victim.read_bytes() == b"precious"
    assert os.stat(root).st_mode & 0o077 == 0


@pytest.mark.parametrize(("code", "match"), [(errno.ENOSPC, "disk full"), (errno.EACCES, "permissions")])
def test_a_disk_that_refuses_the_manifest_ends_in_one_line(tmp_path, host_folder, monkeypatch, code, match):
    folder, _, digest = host_folder
    net = FakeNet()
    net.handlers["QmBoot"] = serving(folder, digest).handle
    f = fetcher(tmp_path, digest, net)

    def refuses(path, data, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(cache_module, "write_atomic", refuses)
    with pytest.raises(DataError, match=match) as caught:
        asyncio.run(f.fetch_manifest())
    assert "\n" not in str(caught.value) and (code != errno.ENOSPC or isinstance(caught.value, DiskFull))
    assert f.stats.refused == set()  # the host did nothing wrong


def test_a_damaged_note_of_verified_chunks_is_fetched_again_not_a_crash(tmp_path, host_folder):
    folder, manifest, digest = host_folder
    entry = manifest.train[0]
    net = FakeNet()
    net.handlers["QmBoot"] = serving(folder, digest).handle
    f = fetcher(tmp_path, digest, net)
    asyncio.run(f.fetch_manifest())
    f.cache.start_partial(entry)
    (tmp_path / "cache" / f"{entry.name}.have").write_bytes(b"\xff\xfe[0, 1]")  # not UTF-8
    assert f.cache.verified_chunks(entry) == set()
    asyncio.run(f.fetch(entry))
    assert (tmp_path / "cache" / entry.name).read_bytes() == (folder / entry.name).read_bytes()


def test_whole_files_are_hashed_a_block_at_a_time(tmp_path, host_folder, monkeypatch):
    """Checking a shard never reads it whole into memory (shards may be large)."""
    from pathlib import Path

    folder, manifest, digest = host_folder
    entry = manifest.train[0]
    net = FakeNet()
    net.handlers["QmBoot"] = serving(folder, digest).handle
    f = fetcher(tmp_path, digest, net)
    asyncio.run(f.fetch_manifest())
    real = Path.read_bytes

    def small_files_only(path):
        assert not path.name.endswith((".tok", ".part")), f"{path.name} read whole"
        return real(path)

    monkeypatch.setattr(Path, "read_bytes", small_files_only)
    asyncio.run(f.fetch(entry))  # finish() hashes the whole file
    assert entry.held_in(tmp_path / "cache" / entry.name)

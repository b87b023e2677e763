"""A public run on real text (issue 35). The host prepares the bundled docstrings into
shards with `swarm-node data prepare`, which trains a BPE tokenizer on them first, and
starts the bootstrap with `--data`, behind a slow uplink; volunteers on hosts of their
own, holding no data, type the printed line and train. A peer that serves altered bytes joins midway. What
must hold: stage-0 volunteers train disjoint shards in each pass, everything trained
matches the host's bytes, the liar is refused and logged once by each volunteer that
met it, and peers serve each other: the host uploads less than the volunteers fetched."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
from netbed import stop
from swarm_hosts import VENV_BIN, BootstrapOnHost, Volunteer, run_spec_file, volunteer_env, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

LIAR = Path(__file__).with_name("data_liar.py")
SLOTS = 3  # stage-0 volunteers expected: each takes a slot of its own
PASSES = 2  # passes over its slot each stage-0 volunteer completes before the checks


def _docs(workdir: Path, text_bytes: int = 150_000) -> Path:
    """About ``text_bytes`` of the bundled docstrings as text files, as a host has them."""
    from swarm_node.data.dataset import corpus_documents

    docs = workdir / "docs"
    docs.mkdir()
    parts, size = [], 0
    for part in corpus_documents():
        if size > text_bytes:
            break
        parts.append(part[:40_000])
        size += len(parts[-1])
    for i, part in enumerate(parts):
        (docs / f"module-{i:03d}.txt").write_text(part)
    return docs


def _pass_shards(volunteer: Volunteer, data_pass: int) -> set[str]:
    return set(re.findall(rf"data: training (\S+) \(pass {data_pass}, slot", volunteer.text()))


def _passes_done(volunteer: Volunteer) -> int:
    passes = [int(p) for p in re.findall(r"data: training \S+ \(pass (\d+), slot", volunteer.text())]
    return max(passes, default=-1)


def _stage(volunteer: Volunteer) -> int | None:
    found = re.search(r"node \w+: stage (\d+) of", volunteer.text())
    return int(found.group(1)) if found else None


def _fetched(volunteer: Volunteer) -> int:
    lines = [m for m in volunteer.metrics() if "data_fetched_bytes" in m]
    return lines[-1]["data_fetched_bytes"] if lines else 0


def test_volunteers_without_data_train_on_verified_shards_that_peers_serve_each_other(bed, tmp_path):
    host = bed.add_host("boot", rate_mbit=2)  # the host's uplink: the scarce resource of a public run
    digest, spec = _prepare_on(bed, host, tmp_path, shard_tokens=4096, chunk_kb=4, slots=SLOTS)

    boot = BootstrapOnHost(bed, host, tmp_path, "--run-spec", str(spec), "--data", str(tmp_path / "data"))
    line = boot.join_line()
    volunteers = [Volunteer(bed, bed.add_host(f"v{i}"), tmp_path, line) for i in range(2)]

    def training(count: int):
        peers = boot.peers()
        return len(peers) >= count and all(p["verified"] and p["state"] == "training" for p in peers)

    wait_for(lambda: training(2), 300, "the first two volunteers to train", tmp_path)
    volunteers += [Volunteer(bed, bed.add_host(f"v{i}"), tmp_path, line) for i in (2, 3)]
    wait_for(lambda: training(4), 300, "four volunteers to train", tmp_path)

    liar_log = tmp_path / "liar.log"
    liar = bed.popen(bed.add_host("liar"), [sys.executable, str(LIAR), *line.split()[1:], "--stage", "1",
                                            "--compute-share", "0.25"],
                     cwd=tmp_path, env=volunteer_env(XDG_CACHE_HOME=str(tmp_path / "liar-cache")),
                     log=liar_log)
    liar_id = wait_for(lambda: (m := re.search(r"node (\w+): stage 1 of",
                                               liar_log.read_text())) and m.group(1), 300, "the liar to join",
                       tmp_path)
    wait_for(lambda: training(5), 300, "the liar to train", tmp_path)
    volunteers.append(Volunteer(bed, bed.add_host("v4"), tmp_path, line))
    wait_for(lambda: training(6), 300, "the last volunteer to train", tmp_path)

    first = [v for v in volunteers if _stage(v) == 0]
    assert len(first) >= 2, [(_stage(v), v.host.name) for v in volunteers]
    wait_for(lambda: all(_passes_done(v) >= PASSES for v in first), 600,
             f"every stage-0 volunteer to begin pass {PASSES} of its slot", tmp_path)
    wait_for(lambda: all(_fetched(v) > 0 for v in volunteers), 120, "every volunteer's metrics", tmp_path)

    try:
        # Disjoint within each pass: no shard in two volunteers' slots.
        for data_pass in range(PASSES):
            trained = [_pass_shards(v, data_pass) for v in first]
            for i, mine in enumerate(trained):
                for theirs in trained[i + 1:]:
                    assert not mine & theirs, (data_pass, trained)
        # Everything trained, and everything in any cache, is the host's bytes.
        data = tmp_path / "data"
        for v in volunteers:
            cached = list((v.workdir / "cache" / "swarm-node" / "data" / digest[:16]).glob("*.tok"))
            assert cached or _stage(v) != 0, v.host.name
            for path in cached:
                assert _sha(path) == _sha(data / path.name), (v.host.name, path.name)
            assert _sha(v.workdir / "cache" / "swarm-node" / "data" / digest[:16] / "tokenizer.json") == \
                _sha(data / "tokenizer.json")
        # The liar: refused, logged once, by every volunteer that asked it for bytes.
        lied_to = set(re.findall(r"liar: altered chunk \d+ of \S+ for (\w+)", liar_log.read_text()))
        met = [v for v in volunteers if f"refusing {liar_id}" in v.text()]
        assert volunteers[-1] in met and any(_stage(v) == 0 for v in met), [v.host.name for v in met]
        for v in met:
            assert v.text().count(f"data: refusing {liar_id}") == 1, v.host.name
        assert lied_to <= {v.peer_id() for v in met}, (lied_to, [v.peer_id() for v in met])
        # Peers served each other: the host sent less than the volunteers received.
        served = boot.status()["data_served_bytes"]
        fetched = sum(_fetched(v) for v in volunteers)
        assert 0 < served < fetched, (served, fetched)
        print(f"host served {served} bytes; volunteers fetched {fetched}; liar met by "
              f"{len(met)} volunteers")
    finally:
        stop(liar)


def test_a_volunteer_killed_mid_download_resumes_with_what_it_verified(bed, tmp_path):
    """A one-stage run, so the one volunteer trains and fetches shards; its link is slow
    enough that a shard takes seconds. Killed (SIGKILL) with part of a shard verified,
    then started again with the same line, it asks for the other chunks only."""
    host = bed.add_host("boot")
    digest, spec = _prepare_on(bed, host, tmp_path, shard_tokens=131072, chunk_kb=16, slots=1,
                               text_bytes=700_000,
                               num_stages=1)
    boot = BootstrapOnHost(bed, host, tmp_path, "--run-spec", str(spec), "--data", str(tmp_path / "data"))
    volunteer = Volunteer(bed, bed.add_host("v0", rate_mbit=0.5), tmp_path, boot.join_line())
    cache = volunteer.workdir / "cache" / "swarm-node" / "data" / digest[:16]

    def part_way() -> tuple[str, int, int] | None:
        for have in cache.glob("shard-*.tok.have"):
            try:
                done = len(json.loads(have.read_text()))
            except (ValueError, FileNotFoundError):
                continue
            name = have.name.removesuffix(".have")
            total = int(re.search(rf'"chunks":\[([^]]*)\],"name":"{re.escape(name)}"',
                                  (cache / "manifest.json").read_text()).group(1).count(",")) + 1
            if 2 <= done <= total - 4:
                return name, done, total
        return None

    name, done, total = wait_for(part_way, 300, "a shard part-way through its download", tmp_path)
    os.killpg(volunteer.process.pid, signal.SIGKILL)
    volunteer.process.wait(timeout=30)
    verified = len(json.loads((cache / f"{name}.have").read_text()))  # what it had when it died
    assert done <= verified < total
    volunteer.start()
    line = wait_for(
        lambda: re.search(
            rf"data: {re.escape(name)} verified \((\d+) of (\d+) chunks fetched now", volunteer.text()
        ),
        300,
        "the restarted volunteer to finish the shard",
        tmp_path,
    )
    resumed = re.search(rf"data: resuming {re.escape(name)} with (\d+) of (\d+) chunks verified",
                        volunteer.text())
    assert resumed and int(resumed.group(1)) == verified, volunteer.text()[-3000:]
    assert (int(line.group(1)), int(line.group(2))) == (total - verified, total)
    assert _sha(cache / name) == _sha(tmp_path / "data" / name)
    wait_for(lambda: re.search(rf"data: training {re.escape(name)}", volunteer.text()), 120,
             "the restarted volunteer to train the shard", tmp_path)
    stop(volunteer.process)


def _prepare_on(bed, host, workdir: Path, *, shard_tokens: int, chunk_kb: int, slots: int,
                text_bytes: int = 150_000, num_stages: int = 2) -> tuple[str, Path]:
    """`swarm-node data prepare` on the host, training a BPE tokenizer of 1,000 tokens on the
    text as it goes, and a run spec naming its manifest."""
    docs = _docs(workdir, text_bytes)
    log = workdir / "prepare.log"
    prepared = bed.popen(host, [str(VENV_BIN / "swarm-node"), "data", "prepare", f"text:{docs}", "--out",
                                str(workdir / "data"), "--train-tokenizer", "1000", "--shard-tokens",
                                str(shard_tokens), "--chunk-kb", str(chunk_kb), "--no-progress"], cwd=workdir,
                         env=volunteer_env(), log=log)
    assert prepared.wait(timeout=300) == 0, log.read_text()
    digest = re.search(r'manifest_sha256 = "([0-9a-f]{64})"', log.read_text()).group(1)
    spec = run_spec_file(workdir, inner_steps=10, run_id="real-text")
    text = re.sub(r"(?ms)^\[data\].*?(?=^\[method\])",
                  f'[data]\nkind = "manifest"\nmanifest_sha256 = "{digest}"\nslots = {slots}\n\n',
                  spec.read_text())
    spec.write_text(re.sub(r"(?m)^num_stages = \d+", f"num_stages = {num_stages}", text))
    return digest, spec


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()

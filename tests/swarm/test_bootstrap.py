"""Hosting a bootstrap and joining a run with nothing but its multiaddr, with real
processes on loopback: the printed address, identity across restarts, /api/status,
/metrics, the dashboard in headless Chromium, a stock hivemind DHT reading the spec,
refusals, and training that outlives the bootstrap."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
from bootstrap_harness import EXAMPLE_SPEC, REPO, Bootstrap, free_port, join, stop, wait_for
from prometheus_client.parser import text_string_to_metric_families

from swarm_node.net.dht import SwarmDHT
from swarm_node.registry import read_stage
from swarm_node.spec import RunSpec

MAX_STEPS = 2000  # stage 0 stops here; long enough that the checks below run mid-training
ARTIFACTS = Path(os.environ.get("SWARM_TEST_ARTIFACTS", REPO / "test-artifacts"))


def test_bootstrap_restarted_with_its_identity_keeps_peer_id_and_multiaddr(tmp_path):
    identity, port = tmp_path / "keys" / "boot.key", free_port()
    first = Bootstrap(tmp_path, identity, port, "--run-spec", str(EXAMPLE_SPEC), name="first")
    first.wait_ready()
    assert stop(first.process) == 0  # SIGTERM: a clean exit
    assert oct(identity.stat().st_mode & 0o777) == "0o400"
    second = Bootstrap(tmp_path, identity, port, "--run-spec", str(EXAMPLE_SPEC), name="second")
    try:
        second.wait_ready()
        assert (second.maddr, second.peer_id) == (first.maddr, first.peer_id)
        assert second.get("/healthz") == (200, b"ok\n")
    finally:
        assert stop(second.process) == 0


def test_a_node_whose_only_initial_peer_is_down_says_so(tmp_path):
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/QmThsSHm777ukMCEAP4cKZztG2bkbTbocai2dzyWhmbKEH"
    proc = join(tmp_path, "lonely", "--initial-peers", dead, "--no-progress")
    assert proc.wait(timeout=90) == 2
    last = (tmp_path / "lonely.log").read_text().strip().splitlines()[-1]
    assert last.startswith("swarm-node join: error: none of the initial peers answered"), last


@pytest.fixture(scope="module")
def public_run(tmp_path_factory):
    """A bootstrap serving the example spec, a second bootstrap serving whatever the
    first publishes, and two nodes given only the first one's multiaddr."""
    workdir = tmp_path_factory.mktemp("public-run")
    # exactly the acceptance command: any port, any HTTP port, the example spec
    boot = Bootstrap(workdir, workdir / "boot.key", 0, "--run-spec", str(EXAMPLE_SPEC))
    ready_s = boot.wait_ready(timeout_s=20)
    second = Bootstrap(workdir, workdir / "second.key", 0, "--initial-peers", boot.maddr, name="second")
    second.wait_ready(timeout_s=40)
    status_port = ("--http-port", "0")  # node0 serves its own /healthz and /metrics
    nodes = [join(workdir, f"node{i}", "--initial-peers", boot.maddr, "--max-steps", str(MAX_STEPS),
                  "--threads", "1", "--no-progress", "--run-dir", str(workdir), *(status_port if i == 0 else ()))
             for i in range(2)]
    yield {"boot": boot, "second": second, "nodes": nodes, "workdir": workdir, "ready_s": ready_s}
    for proc in [*nodes, boot.process, second.process]:
        stop(proc)


def _training_peers(boot: Bootstrap) -> list[dict]:
    return [p for s in boot.status()["stages"] for p in s["peers"] if p["state"] == "training" and p["inner_step"]]


def test_nodes_given_only_the_printed_multiaddr_train_together_and_appear_in_status(public_run):
    boot = public_run["boot"]
    assert public_run["ready_s"] < 20
    peers = wait_for(lambda: len(_training_peers(boot)) == 2 and _training_peers(boot), 90,
                     "both nodes in /api/status", public_run["workdir"])
    status = boot.status()
    assert {p["stage"] for p in peers} == {0, 1}  # they chose different stages by themselves
    assert status["run_id"] == "debug-synthetic" and status["spec_key"] == f"swarm-node/spec/{boot.peer_id}"
    assert status["spec_hash"] == RunSpec.from_file(EXAMPLE_SPEC).spec_hash()
    assert status["bootstrap"]["maddrs"][0] == boot.maddr
    first = {p["peer_id"]: p["inner_step"] for p in peers}
    wait_for(lambda: all(p["inner_step"] > first.get(p["peer_id"], 0) + 20 for p in _training_peers(boot)), 60,
             "both nodes to keep stepping")
    assert wait_for(lambda: boot.status()["loss"], 30, "a loss from the last stage") < 3.0
    for i in range(2):
        log = (public_run["workdir"] / f"node{i}.log").read_text()
        assert f"published by {boot.peer_id[-6:]}" in log


def test_a_second_bootstrap_serves_the_same_run(public_run):
    boot, second = public_run["boot"], public_run["second"]
    wait_for(lambda: len(_training_peers(boot)) == 2, 90, "both nodes", public_run["workdir"])
    status = wait_for(lambda: len(_training_peers(second)) == 2 and second.status(), 30,
                      "the second bootstrap to see both nodes")
    assert status["spec_hash"] == boot.status()["spec_hash"] and status["spec_key"].endswith(second.peer_id)
    assert "serving run 'debug-synthetic' as published by" in second.err_path.read_text()


def test_metrics_parse_with_the_prometheus_parser(public_run):
    boot = public_run["boot"]
    wait_for(lambda: len(_training_peers(boot)) == 2, 90, "both nodes", public_run["workdir"])
    code, body = boot.get("/metrics")
    assert code == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    assert samples[("swarm_bootstrap_up", ())] == 1
    assert sum(v for (name, labels), v in samples.items()
               if name == "swarm_peers" and ("state", "training") in labels) == 2
    assert sum(1 for name, _ in samples if name == "swarm_peer_inner_step") == 2


def test_a_node_serves_healthz_and_its_own_metrics(public_run):
    boot, workdir = public_run["boot"], public_run["workdir"]
    wait_for(lambda: len(_training_peers(boot)) == 2, 90, "both nodes", workdir)
    url = re.search(r"status endpoints: (http://\S+)/healthz", (workdir / "node0.log").read_text()).group(1)
    with urllib.request.urlopen(f"{url}/healthz", timeout=10) as reply:
        assert reply.status == 200 and reply.read().startswith(b"ok: training")
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
    step = families["swarm_node_inner_step"].samples[0]
    assert step.value > 0 and step.labels["stage"] in ("0", "1")
    assert families["swarm_node_bytes_sent"].samples[0].value > 0
    with urllib.request.urlopen(f"{url}/api/status", timeout=10) as reply:
        status = json.loads(reply.read())
    assert status["run_id"] == "debug-synthetic" and status["record"]["state"] == "training"


def test_a_stock_hivemind_dht_reads_the_run_spec(public_run):
    from hivemind import DHT
    from hivemind.dht.crypto import RSASignatureValidator

    boot = public_run["boot"]
    spec_key = boot.status()["spec_key"]
    # Plain hivemind, as any hivemind program would read a signed record.
    dht = DHT(initial_peers=[boot.maddr], start=True, record_validators=[RSASignatureValidator()])
    try:
        found = dht.get(spec_key, latest=True)
    finally:
        dht.shutdown()
    assert found is not None
    entries = [entry.value for entry in found.value.values()]
    assert len(entries) == 1 and entries[0]["run_id"] == "debug-synthetic"
    assert RunSpec.from_dict(json.loads(entries[0]["spec"])).spec_hash() == entries[0]["spec_hash"]


def test_dashboard_shows_the_peer_table_and_a_loss_plot_from_real_data(public_run, chromium):
    boot = public_run["boot"]
    wait_for(lambda: len(_training_peers(boot)) == 2, 90, "both nodes", public_run["workdir"])
    wait_for(lambda: sum(p["loss"] is not None for p in json.loads(boot.get("/api/history")[1])) >= 3, 60,
             "three loss points in the history")
    browser = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=8000"]
    dom = subprocess.run([*browser, "--dump-dom", boot.url], capture_output=True, text=True, timeout=120).stdout
    rows = re.findall(r'<tr class="peer-row" data-peer="(\w+)"', dom)
    assert sorted(rows) == sorted(p["peer_id"] for p in _training_peers(boot)), dom[-3000:]
    loss_plot = re.search(r'<svg id="loss-plot".*?</svg>', dom, re.S).group(0)
    count = int(re.search(r'<polyline class="series"[^>]*data-count="(\d+)"', loss_plot).group(1))
    assert count >= 3
    assert "updated " in re.search(r'id="updated">([^<]*)<', dom).group(1)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    subprocess.run([*browser, "--window-size=1200,1000", f"--screenshot={shot}", boot.url], capture_output=True,
                   timeout=120, cwd=ARTIFACTS)
    assert shot.stat().st_size > 10_000


def test_a_node_with_an_incompatible_spec_refuses_and_exits_nonzero(public_run, tmp_path):
    other = tmp_path / "other.toml"
    other.write_text(EXAMPLE_SPEC.read_text().replace("seq_len = 64", "seq_len = 32"))
    proc = join(tmp_path, "wrong", "--initial-peers", public_run["boot"].maddr, "--config", str(other),
                "--no-progress")
    assert proc.wait(timeout=90) == 2
    last = (tmp_path / "wrong.log").read_text().strip().splitlines()[-1]
    assert "your run spec file has hash" in last and "leave the file out" in last, last


def test_killing_every_bootstrap_does_not_stop_training(public_run):
    boot, nodes, workdir = public_run["boot"], public_run["nodes"], public_run["workdir"]
    stage0 = wait_for(lambda: next((p for p in _training_peers(boot) if p["stage"] == 0), None), 60, "stage 0")
    assert stage0["inner_step"] < MAX_STEPS * 0.8, "the run finished before the bootstraps could be killed"
    # An observer that knows the nodes directly (their logs print their multiaddrs), not through a bootstrap.
    node_maddrs = [re.search(r"--initial-peers (\S+)", (workdir / f"node{i}.log").read_text()).group(1)
                   for i in range(2)]
    loop = asyncio.new_event_loop()
    observer = loop.run_until_complete(SwarmDHT.start(initial_peers=node_maddrs))
    try:
        for process in (boot.process, public_run["second"].process):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        at_kill = {stage: _steps(loop, observer, stage) for stage in (0, 1)}
        assert min(at_kill.values()) > 0

        def trained_on() -> bool:
            assert all(node.poll() in (None, 0) for node in nodes)
            return all(_steps(loop, observer, stage) >= at_kill[stage] + 150 for stage in (0, 1))

        wait_for(trained_on, 120, "both stages to keep stepping with every bootstrap gone", workdir)
    finally:
        loop.run_until_complete(observer.shutdown())
        loop.close()


def _steps(loop, observer, stage: int) -> int:
    records, _ = loop.run_until_complete(read_stage(observer, "debug-synthetic", stage))
    return max((r.inner_step for r in records.values()), default=0)

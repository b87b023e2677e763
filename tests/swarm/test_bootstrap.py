"""A bootstrap on loopback: its identity and address across restarts, and a node whose
only initial peer is down. A public run between hosts is tests/multihost/test_public_run.py."""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.error
import urllib.request

from bootstrap_harness import EXAMPLE_SPEC, Bootstrap, free_port, join, stop, wait_for
from prometheus_client.parser import text_string_to_metric_families

from swarm_node.spec import RunSpec


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


def test_a_node_serves_healthz_and_its_own_metrics(tmp_path):
    spec_path = tmp_path / "alone.json"
    dataclasses.replace(RunSpec.from_file(EXAMPLE_SPEC), run_id="alone", num_stages=1).write_json(spec_path)
    proc = join(tmp_path, "node", "--config", str(spec_path), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                "--http-port", "0", "--threads", "1", "--no-progress")
    try:
        url = wait_for(lambda: re.search(r"status endpoints: (http://\S+)/healthz",
                                         (tmp_path / "node.log").read_text()), 90, "the status endpoints",
                       tmp_path).group(1)

        def get(path: str) -> bytes:
            try:
                with urllib.request.urlopen(f"{url}{path}", timeout=10) as reply:
                    return reply.read()
            except urllib.error.HTTPError as exc:  # 503 while it starts
                return exc.read()

        assert wait_for(lambda: get("/healthz").startswith(b"ok: training"), 60, "a healthy node")
        families = wait_for(
            lambda: (
                (f := {f.name: f for f in text_string_to_metric_families(get("/metrics").decode())})
                and f["swarm_node_inner_step"].samples[0].value > 0
                and f
            ),
            60,
            "inner steps",
        )
        assert families["swarm_node_inner_step"].samples[0].labels["stage"] == "0"
        assert "swarm_node_bytes_sent" in families
        status = json.loads(get("/api/status"))
        assert status["run_id"] == "alone" and status["record"]["state"] == "training"
    finally:
        assert stop(proc) == 0

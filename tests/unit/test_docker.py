"""docker-compose.yml and the Dockerfile, checked statically (no Docker engine runs on
these machines): the services a run needs, their ports, volumes, health checks and
stop grace, and that every command they run parses with the real command lines."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from swarm_bootstrap.cli import build_parser as bootstrap_parser
from swarm_node.cli import build_parser as node_parser

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
NODES = {name: s for name, s in SERVICES.items() if s["command"][:2] == ["swarm-node", "join"]}


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def parse(command: list[str]):
    parser = {"swarm-node": node_parser, "swarm-bootstrap": bootstrap_parser}[command[0]]()
    return parser.parse_args(command[1:])


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (REPO / "Dockerfile").read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_compose_runs_a_bootstrap_and_two_stages_of_two_nodes_on_a_private_network():
    assert SERVICES["bootstrap"]["command"][0] == "swarm-bootstrap"
    stages = sorted(int(option(s["command"], "--stage")) for s in NODES.values())
    assert stages == [0, 0, 1, 1]
    assert set(COMPOSE["networks"]) == {"swarm"} and COMPOSE["networks"]["swarm"]["driver"] == "bridge"
    for service in SERVICES.values():
        assert service["networks"] == ["swarm"]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_command_parses_with_the_real_command_line(name):
    command = SERVICES[name]["command"]
    args = parse(command)
    if command[0] == "swarm-node":
        assert args.http_host == "0.0.0.0"  # reachable by the health check and a scraper


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_health_checks_its_own_healthz_and_has_a_stop_grace_period(name):
    service = SERVICES[name]
    port = option(service["command"], "--http-port")
    probe = " ".join(service["healthcheck"]["test"])
    assert f"http://127.0.0.1:{port}/healthz" in probe
    grace_s = int(service["stop_grace_period"].rstrip("s"))
    assert grace_s >= 30
    if name in NODES:  # a node writes its shutdown checkpoint (bounded at 60 s) before exiting
        assert grace_s > 60


def test_bootstrap_publishes_its_ports_keeps_its_identity_in_a_volume_and_tells_nodes_its_address():
    boot = SERVICES["bootstrap"]
    command = boot["command"]
    libp2p_port = option(command, "--host-maddrs").rsplit("/", 1)[1]
    assert f"{libp2p_port}:{libp2p_port}" in boot["ports"]
    http_port = option(command, "--http-port")
    assert f"{http_port}:{http_port}" in boot["ports"]
    identity_dir = str(Path(option(command, "--identity")).parent)
    mounts = dict(v.split(":")[:2][::-1] for v in boot["volumes"])
    assert mounts[identity_dir] == "bootstrap-identity" and "bootstrap-identity" in COMPOSE["volumes"]
    maddrs_file = option(command, "--maddrs-file")
    shared = mounts[str(Path(maddrs_file).parent)]
    for name, node in NODES.items():
        assert option(node["command"], "--initial-peers-file") == maddrs_file
        node_mounts = dict(v.split(":")[:2][::-1] for v in node["volumes"])
        assert node_mounts[str(Path(maddrs_file).parent)] == shared
        assert node["depends_on"]["bootstrap"]["condition"] == "service_healthy"
        state = node_mounts[str(Path(option(node["command"], "--checkpoint-dir")).parent)]
        assert state == name and state in COMPOSE["volumes"]  # each node its own key and checkpoints


def test_compose_and_the_dockerfile_use_the_same_image_and_commands_answer_help():
    assert {s["image"] for s in SERVICES.values()} == {"swarm-node:latest"} and SERVICES["bootstrap"]["build"] == "."
    for program, sub in (("swarm-bootstrap", []), ("swarm-node", ["join"])):
        done = subprocess.run([str(Path(sys.executable).parent / program), *sub, "--help"], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0 and "usage:" in done.stdout


def test_dockerfile_builds_cpu_by_default_cuda_by_build_arg_and_runs_unprivileged():
    instructions = dockerfile()
    args = dict(re.match(r"(\w+)=?(.*)", a).groups() for kind, a in instructions if kind == "ARG")
    assert args["BASE_IMAGE"] == "python:3.11-slim" and args["TORCH_VARIANT"] == "cpu"
    dev_sh_torch = re.search(r'TORCH_VERSION="\$\{SWARM_TORCH_VERSION:-([\d.]+)\}"', (REPO / "dev.sh").read_text())
    assert args["TORCH_VERSION"] == dev_sh_torch.group(1)  # the version the tests run with
    assert ("FROM", "${BASE_IMAGE}") in instructions
    runs = " ".join(a for kind, a in instructions if kind == "RUN")
    assert "download.pytorch.org/whl/${TORCH_VARIANT}" in runs  # never the multi-GB default CUDA wheel
    for kind, arguments in instructions:
        if kind == "COPY":
            *sources, _ = shlex.split(arguments)
            assert all((REPO / s).exists() for s in sources), arguments
    assert [a for kind, a in instructions if kind == "USER"] == ["swarm"]
    assert set(" ".join(a for kind, a in instructions if kind == "EXPOSE").split()) == {"31337", "8080"}
    health = next(a for kind, a in instructions if kind == "HEALTHCHECK")
    assert "/healthz" in health and "--start-period" in health
    cmd = json.loads(next(a for kind, a in instructions if kind == "CMD"))  # exec form
    assert cmd[0] in ("swarm-node", "swarm-bootstrap")


def test_the_readme_docker_section_matches_the_files():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Docker"):]
    section = section[:section.index("\n## ", 1)]
    for name in SERVICES:
        assert f"`{name}`" in section or name.startswith("node-"), name
    for build_arg in re.findall(r"--build-arg (\w+)=", section):
        assert any(kind == "ARG" and a.startswith(build_arg) for kind, a in dockerfile()), build_arg
    for port in ("8080", "31337"):
        assert port in section
    assert "docker compose up --build" in section and "docker build" in section

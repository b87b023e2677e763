"""docker-compose.yml and the Dockerfile, checked statically (no Docker engine runs on
these machines): a format both Compose v1 and v2 read, the services a run needs, their
ports, announce addresses, volumes, health checks and stop grace, and that every command
they run parses with the real command lines. Where a Compose CLI is installed, it checks
the file too."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hivemind.utils.multiaddr import Multiaddr
from swarm_bootstrap.cli import build_parser as bootstrap_parser

from swarm_node.cli.main import build_parser as node_parser
from swarm_node.net.dialback import ordered_for_others

REPO = Path(__file__).resolve().parents[2]
COMPOSE_TEXT = (REPO / "docker-compose.yml").read_text()
VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")  # ${NAME} or ${NAME:-default}, as Compose reads them


def interpolate(value, env: dict[str, str]):
    """What Compose runs for a value of the file, given the variables of an .env."""
    if isinstance(value, str):
        return VARIABLE.sub(lambda m: env.get(m.group(1)) or m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


RAW = yaml.safe_load(COMPOSE_TEXT)
COMPOSE = interpolate(RAW, {})  # as run without an .env
SERVICES = COMPOSE["services"]
NODES = {name: s for name, s in SERVICES.items() if s["command"][:2] == ["swarm-node", "join"]}
COMPOSE_V24_TOP_LEVEL = {"version", "services", "networks", "volumes"}


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
    assert {s["image"] for s in SERVICES.values()} == {"swarm-node:latest"} and SERVICES["bootstrap"][
        "build"
    ] == "."
    for program, sub in (("swarm-bootstrap", []), ("swarm-node", ["join"])):
        done = subprocess.run([str(Path(sys.executable).parent / program), *sub, "--help"],
                              capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0 and "usage:" in done.stdout


def test_dockerfile_builds_cpu_by_default_cuda_by_build_arg_and_runs_unprivileged():
    instructions = dockerfile()
    args = dict(re.match(r"(\w+)=?(.*)", a).groups() for kind, a in instructions if kind == "ARG")
    assert args["BASE_IMAGE"] == "python:3.13-slim" and args["TORCH_VARIANT"] == "cpu"
    dev_sh_torch = re.search(r'TORCH_VERSION="\$\{SWARM_TORCH_VERSION:-([\d.]+)\}"',
                             (REPO / "dev.sh").read_text())
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


def readme_docker_section() -> str:
    """The hosts' guide's Docker section, up to the next heading of its level (or the end)."""
    guide = (REPO / "docs" / "HOSTS.md").read_text()
    section = guide[guide.index("\n## Docker\n"):]
    end = section.find("\n## ", 1)
    return section if end < 0 else section[:end]


def test_the_readme_docker_section_matches_the_files():
    section = readme_docker_section()
    for name in SERVICES:
        assert f"`{name}`" in section or name.startswith("node-"), name
    for build_arg in re.findall(r"--build-arg (\w+)=", section):
        assert any(kind == "ARG" and a.startswith(build_arg) for kind, a in dockerfile()), build_arg
    for port in ("8080", "31337"):
        assert port in section
    assert "docker compose up --build" in section and "docker build" in section


def test_compose_file_is_in_the_2_4_format_that_compose_v1_and_v2_both_read():
    # Compose v1 (docker-compose 1.29) reads a file without `version` as the legacy v1
    # format and refuses a top-level `name`; v2 reads 2.4 and only warns that it is obsolete.
    assert RAW["version"] == "2.4"  # a string: both refuse the number 2.4
    assert set(RAW) - COMPOSE_V24_TOP_LEVEL <= {k for k in RAW if k.startswith("x-")}, set(RAW)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_can_build_its_image(name):
    assert SERVICES[name]["build"] == "." and SERVICES[name]["image"] == "swarm-node:latest"


def libp2p_port(command: list[str]) -> int:
    (listen,) = option_values(command, "--host-maddrs")
    assert re.fullmatch(r"/ip4/0\.0\.0\.0/tcp/\d+", listen), listen  # every interface of the container
    return int(listen.rsplit("/", 1)[1])


def option_values(command: list[str], flag: str) -> list[str]:
    start = command.index(flag) + 1
    end = next((i for i in range(start, len(command)) if command[i].startswith("--")), len(command))
    return command[start:end]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_peer_announces_the_hosts_public_address_on_its_own_port_published_with_the_same_number(name):
    service = RAW["services"][name]
    port = libp2p_port(service["command"])
    assert f"{port}:{port}" in service["ports"]
    announced = option_values(service["command"], "--announce-maddrs")
    # The one variable of .env for the host's address, and the service's name in the compose
    # network for the other containers (no hairpin NAT needed, and 127.0.0.1 in a container
    # is the container itself).
    assert announced == [f"/ip4/${{SWARM_PUBLIC_IP:-127.0.0.1}}/tcp/{port}", f"/dns4/{name}/tcp/{port}"]
    for maddr in interpolate(announced, {"SWARM_PUBLIC_IP": "198.51.100.20"}):
        Multiaddr(maddr)  # raises on a malformed address


def test_every_peer_has_a_libp2p_port_of_its_own():
    ports = [libp2p_port(s["command"]) for s in SERVICES.values()]
    assert len(set(ports)) == len(ports) == 5, ports


def test_the_bootstrap_prints_the_public_address_first_for_volunteers():
    announced = option_values(SERVICES["bootstrap"]["command"], "--announce-maddrs")
    public = interpolate(option_values(RAW["services"]["bootstrap"]["command"], "--announce-maddrs"),
                         {"SWARM_PUBLIC_IP": "8.8.8.8"})
    peer = "/p2p/QmThsS"
    assert ordered_for_others([m + peer for m in public])[0] == "/ip4/8.8.8.8/tcp/31337" + peer
    # a home network's or this host's address still comes before the service name only the containers resolve
    for ip in ("192.168.1.20", "127.0.0.1"):
        home = interpolate(option_values(RAW["services"]["bootstrap"]["command"], "--announce-maddrs"),
                           {"SWARM_PUBLIC_IP": ip})
        assert ordered_for_others([m + peer for m in reversed(home)])[0] == f"/ip4/{ip}/tcp/31337" + peer
    assert announced[0] == "/ip4/127.0.0.1/tcp/31337"  # without an .env: a run on this host alone


def strings(value) -> list[str]:
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*strings(k), *strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return [value] if isinstance(value, str) else []


def test_the_host_sets_one_variable_in_env_which_env_example_documents():
    values = [s for s in strings(RAW) if "$" in s]
    assert values and all("$" not in s.replace("${SWARM_PUBLIC_IP:-127.0.0.1}", "") for s in values), values
    example = dict(line.split("=", 1) for line in (REPO / ".env.example").read_text().splitlines()
                   if line.strip() and not line.startswith("#"))
    # SWARM_PUBLIC_IP as the file's default. Volume names carry the project name: a fixed one
    # keeps the bootstrap's key (its address) whatever the checkout's folder is called.
    assert example == {"SWARM_PUBLIC_IP": "127.0.0.1", "COMPOSE_PROJECT_NAME": "swarm-node"}
    assert ".env" in (REPO / ".dockerignore").read_text().split()  # the host's settings stay out of the image


def compose_clis() -> list[list[str]]:
    found = []
    if shutil.which("docker-compose"):
        found.append(["docker-compose"])
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 timeout=60).returncode == 0:
        found.append(["docker", "compose"])
    return found


def test_an_installed_compose_cli_accepts_the_file():
    clis = compose_clis()
    if not clis:
        pytest.skip("no Compose CLI installed (docker-compose, or docker with the compose plugin)")
    env = {**os.environ, "SWARM_PUBLIC_IP": "198.51.100.20"}
    for cli in clis:
        done = subprocess.run([*cli, "-f", str(REPO / "docker-compose.yml"), "config", "-q"],
                              capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
        assert done.returncode == 0, (cli, done.stderr)


def test_the_readme_tells_a_host_how_to_run_it_and_a_volunteer_how_to_join():
    section = readme_docker_section()
    assert "cp .env.example .env" in section and "SWARM_PUBLIC_IP" in section
    assert "docker compose up --build" in section and "docker-compose up --build" in section
    ranges = [range(int(a), int(b) + 1) for a, b in re.findall(r"\b(\d{4,5})-(\d{4,5})\b", section)]
    for service in SERVICES.values():
        for published in (p.split(":")[0] for p in service.get("ports", [])):
            assert published in section or any(int(published) in r for r in ranges), published
    assert "swarm-node join --initial-peers" in section and "/ip4/SWARM_PUBLIC_IP/tcp/31337/p2p/" in section
    assert f'version: "{RAW["version"]}"' in section

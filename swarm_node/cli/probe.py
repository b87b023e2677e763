"""Command line of `swarm-node probe` (parsing and process handling only; the probe is
swarm_node/probe/libp2p_probe.py, run by a Python of its own).

py-libp2p runs on trio and registers the same protobuf package as hivemind, with a
different protobuf pin, so it gets a virtual environment of its own (``--setup``; by
default ~/.cache/swarm-node/probe-venv, or $SWARM_PROBE_VENV) and runs in a child process."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import venv
from pathlib import Path

from swarm_node.net.maddr import check_maddrs
from swarm_node.probe import SCRIPT

# The probe is written against py-libp2p 0.8 (its host, Noise/TLS, yamux and stream APIs
# change between minor releases); msgpack for the node's frames.
PROBE_REQUIREMENTS = ("libp2p>=0.8,<0.9", "msgpack>=1.0")
EXIT_NOT_SET_UP = 3


def probe_venv() -> Path:
    return Path(os.environ.get("SWARM_PROBE_VENV") or Path.home() / ".cache" / "swarm-node" / "probe-venv")


def venv_python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def add_probe_parser(sub) -> None:
    p = sub.add_parser(
        "probe",
        help="check a node from outside with py-libp2p: connect, ping, identify, status",
        description="Dial a node with py-libp2p (another libp2p implementation) over TCP with "
        "Noise or TLS and yamux, ping it, read its identify record and ask its status over "
        "/swarm-node/status/1.0.0 (docs/PROTOCOL.md). The last line is the verdict; the exit status is 0 "
        "when the node answered. py-libp2p lives in a virtual environment of its own: create it once with "
        "`swarm-node probe --setup`.",
    )
    p.add_argument("maddr", nargs="?", metavar="MADDR",
                   help="the node's multiaddr, ending in /p2p/<peer id> (as its log prints it)")
    p.add_argument("--timeout", type=float, default=20.0, metavar="S",
                   help="seconds for the whole check (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument("--security", choices=("noise", "tls"), default="noise",
                   help="secure channel to use (default %(default)s)")
    p.add_argument("--probe-python", type=Path, default=None, metavar="PATH",
                   help="a Python with py-libp2p installed (default: the --setup environment's)")
    p.add_argument("--setup", action="store_true",
                   help="create the probe's environment (pip install of py-libp2p and msgpack) and exit")
    p.set_defaults(handler=_run_probe)


def _run_probe(args: argparse.Namespace) -> int:
    if args.setup:
        return setup_probe_venv(probe_venv())
    if not args.maddr:
        raise ValueError("give the node's multiaddr (MADDR), or --setup to create the probe's environment")
    check_maddrs([args.maddr], "MADDR", peer_id=True)
    python = args.probe_python or venv_python(probe_venv())
    if not python.exists():
        print(
            f"swarm-node probe: py-libp2p is not set up ({python} is missing): "
            "run `swarm-node probe --setup`",
            file=sys.stderr,
        )
        return EXIT_NOT_SET_UP
    cmd = [str(python), "-I", str(SCRIPT), args.maddr, "--timeout", str(args.timeout), "--security",
           args.security]
    if args.json:
        cmd.append("--json")
    if args.verbose:
        cmd.append("--verbose")
    try:  # the child owns its deadline; the margin covers its start-up (imports take ~1 s)
        return subprocess.run(cmd, timeout=args.timeout + 30).returncode
    except subprocess.TimeoutExpired:
        print(f"swarm-node probe: the probe did not finish within {args.timeout + 30:.0f} s", file=sys.stderr)
        return 1


def setup_probe_venv(path: Path) -> int:
    """Create (or reuse) the probe's virtual environment and install py-libp2p into it."""
    python = venv_python(path)
    if python.exists():
        print(f"reusing the probe environment {path}", file=sys.stderr)
    else:
        print(
            f"creating a virtual environment for py-libp2p at {path} (separate from this one: py-libp2p and "
            "hivemind pin protobuf differently)",
            file=sys.stderr,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        venv.EnvBuilder(with_pip=True, clear=False).create(path)
    install = [str(python), "-m", "pip", "install", "--disable-pip-version-check", *PROBE_REQUIREMENTS]
    print(f"installing: {' '.join(install)}", file=sys.stderr)
    if subprocess.run(install).returncode != 0:
        print(f"swarm-node probe: pip could not install {' '.join(PROBE_REQUIREMENTS)} into {path}",
              file=sys.stderr)
        return 1
    check = subprocess.run([str(python), "-I", str(SCRIPT), "--check-install"], capture_output=True,
                           text=True)
    if check.returncode != 0:
        print(
            f"swarm-node probe: the probe does not start in {path}: "
            f"{check.stdout.strip()}{check.stderr[-500:]}",
            file=sys.stderr,
        )
        return 1
    print(f"probe ready: {check.stdout.strip()}; run `swarm-node probe MADDR`", file=sys.stderr)
    return 0

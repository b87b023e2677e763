"""What the subcommands' flags share: their argument types, named choices and help texts."""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm_node.errors import ConfigError

# wire/outer_codec.py's table and wire/messages.py's (a test keeps them equal): the parser
# runs before torch is imported
OUTER_CODEC_NAMES = ("fp32", "fp16", "bf16", "int8", "int4", "near4-4", "near4-3")
ACTIVATION_CODEC_NAMES = ("fp32", "fp16", "bf16", "int8")
BOUNDARY_CODEC_NAMES = ("bottleneck4", "bottleneck8", "subspace4", "subspace8")  # wire/boundary.py's
OUTER_LANDING_NAMES = ("whole", "delta-first")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


MODEL_HELP = (
    "debug (2 layers) | mini (4) | tiny (4) | small (12) | medium (24) | large (32); default: %(default)s"
)
DATA_HELP = (
    "synthetic[:alphabet=16,order=2,...] | corpus (the bundled docstrings) | text:PATH | bin:PATH | hf:PATH "
    "| manifest:FOLDER (prepared by `swarm-node data prepare`) | PATH; default: %(default)s"
)
THREADS_DEFAULT_HELP = (
    "default: the cores not already busy (measured over half a second at the start), at least "
    "1: more threads than free cores leave torch's threads spinning, waiting for each other"
)


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def unit_share(text: str) -> float:
    from swarm_node.node_config import check_compute_share  # here: swarm-bootstrap's parser imports no torch

    value = float(text)
    try:
        check_compute_share(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, got {text}") from None
    return value


def above_one(text: str) -> float:
    value = float(text)
    if not value > 1:
        raise argparse.ArgumentTypeError(f"must be above 1, got {text}")
    return value


def check_folder(path: Path | None, flag: str) -> None:
    """A folder flag whose path, or a folder above it, is a file: say so before anything
    is started (creating it would fail with the OS's bare errno text)."""
    if path is None:
        return
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                where = "is a file" if candidate == path else f"is inside {candidate}, which is a file"
                raise ConfigError(f"{flag} {path} {where}: give a folder (it is created if missing)")
            return

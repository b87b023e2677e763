"""Which run-spec key each training flag of `swarm-node local` and `swarm-node sim` sets:
one table, which local builds its run spec from (the flags given make the tables of a
spec file, read as a spec file is), which the simulator's settings follow (a test holds
them to it), and which docs/RESEARCHERS.md prints. `join` has none of these flags: its
run spec is --config's or the one its initial peers publish."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

LOCAL, SIM = "local", "sim"


@dataclass(frozen=True)
class SpecFlag:
    flag: str
    keys: tuple[str, ...]  # dotted, as in a spec file: method.inner_steps is inner_steps of [method]
    commands: tuple[str, ...] = (LOCAL, SIM)

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


SPEC_FLAGS = (
    SpecFlag("--model", ("model_size",)),
    SpecFlag("--stages", ("num_stages",)),
    SpecFlag("--layers-per-stage", ("layers_per_stage",)),
    SpecFlag("--seq-len", ("seq_len",)),
    # one micro-batch per inner step: a node steps after batch_size samples
    SpecFlag("--batch-size", ("batch_size", "samples_per_step")),
    SpecFlag("--steps", ("total_steps",)),
    SpecFlag("--seed", ("seed",)),
    SpecFlag("--data", ("data",)),
    SpecFlag("--tokenizer", ("data.tokenizer_path",), (SIM,)),
    SpecFlag("--method", ("method.name",)),
    SpecFlag("--inner-steps", ("method.inner_steps",)),
    SpecFlag("--group-size", ("method.group_size",), (SIM,)),
    SpecFlag("--alpha", ("method.outer.alpha",), (SIM,)),
    SpecFlag("--beta", ("method.outer.beta",), (SIM,)),
    SpecFlag("--gamma", ("method.outer.gamma",), (SIM,)),
    SpecFlag("--nesterov", ("method.outer.nesterov",), (SIM,)),
    SpecFlag("--lr", ("inner.lr",)),
    SpecFlag("--warmup-steps", ("inner.warmup_steps",), (SIM,)),
    SpecFlag("--weight-decay", ("inner.weight_decay",), (SIM,)),
    SpecFlag("--outer-codec", ("outer_codec",)),
    SpecFlag("--activation-codec", ("activation_codec",)),
    SpecFlag("--activation-ratio", ("activation_ratio",)),
    SpecFlag("--registry-shards", ("registry_shards",), (LOCAL,)),
)


def spec_tables(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The settings ``command``'s flags give, shaped as a spec file's tables ({"method":
    {"inner_steps": 50}, ...}); a flag left at None is left out, so the spec's default
    (or the one it derives, as the learning rate from the model) applies."""
    from swarm_node.data.spec import DataSpec

    tables: dict[str, Any] = {}
    for row in SPEC_FLAGS:
        value = getattr(args, row.dest) if command in row.commands else None
        if value is None:
            continue
        if row.flag == "--data":
            value = dataclasses.asdict(DataSpec.parse(value))
        for key in row.keys:
            *path, last = key.split(".")
            table = tables
            for name in path:
                table = table.setdefault(name, {})
            table[last] = value
    return tables


def spec_flag_table() -> str:
    """The table as docs/RESEARCHERS.md shows it."""
    lines = ["| flag | run-spec key | commands |", "|---|---|---|"]
    for row in SPEC_FLAGS:
        keys = ", ".join(f"`{key}`" for key in row.keys)
        lines.append(f"| `{row.flag}` | {keys} | {', '.join(row.commands)} |")
    return "\n".join(lines)

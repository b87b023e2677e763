"""What it takes to beat the state check, found by running it: a joiner downloads from a
stage of n peers in process (tests/inproc/state_peers.py), some of them colluding
identities and some honest witnesses kept busy (every sketch and status request told
"busy", as a flood does), for every number of each; the table of docs/ALGORITHM.md 8 is
the fewest colluding identities that get a poisoned state adopted or an honest donor
banned, with none busy and with any number busy.

    .venv/bin/python tests/inproc/state_claim.py     # prints the table (about a minute)

Colluders play each of three ways, and the fewest that win any way is the entry. To get
a poisoned state (theta and phi times 1.5, every colluder holding it) adopted: all vouch
for it (each sketches that same state), all widen the honest witnesses' bounds (a far
state with 1000 times the momentum and progress, a huge partner spread), or half each.
To get an honest donor banned: all disown it (each holds a state times 1.5), all narrow
the bounds too (that state with no momentum, no progress and a zero partner spread), or
half each."""

from __future__ import annotations

import functools
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # run as a script too

import vclock  # noqa: E402
from parts import StageParts  # noqa: E402
from state_peers import SPEC, Stage, joiner, replica  # noqa: E402

from swarm_node.train.worker import StageWorker  # noqa: E402

SIZES = (2, 3, 5, 9)
POISON_PLAYS = ("vouch", "widen", "mixed")
FRAME_PLAYS = ("disown", "narrow", "mixed")
HUGE, NONE = 1e3, 0.0


@functools.cache
def _base() -> StageWorker:
    torch.manual_seed(0)
    return StageWorker(SPEC, 1, 16)


@functools.cache
def _peer(kind: str, index: int) -> StageParts:
    """One peer's state, made once: ``honest`` replicas, the ``poisoned`` state every
    colluder of a poisoning holds, a ``far`` one (widening), ``disowning`` (a state times
    1.5 of its own), ``narrowing`` (that with no momentum and no progress)."""
    base = _base()
    if kind == "honest":
        return replica(base, index)
    if kind == "poisoned":
        return replica(base, 1000, scale=1.5)
    parts = replica(base, 2000 + index, scale=1.5)
    worker = parts.worker
    for p, phi, m in zip(worker.params, worker.slow.phi, worker.slow.momentum):
        if kind == "far":
            m.mul_(HUGE)
            p.data.copy_(phi + HUGE * (p.detach() - phi))
        elif kind == "narrowing":
            m.zero_()
            p.data.copy_(phi)
    return parts


def _colluders(count: int, play: str, first: str) -> list[tuple[str, str, float | None]]:
    """(peer id, kind of state, partner spread it reports) for ``count`` colluding
    witnesses playing ``play``."""
    ways = {"vouch": ("poisoned", None), "widen": ("far", HUGE), "disown": ("disowning", None),
            "narrow": ("narrowing", NONE)}
    plays = (
        [play] * count if play != "mixed" else [first if i % 2 == 0 else _other(first) for i in range(count)]
    )
    return [(f"QmL{i + 1}", *ways[p]) for i, p in enumerate(plays)]


def _other(play: str) -> str:
    return {"vouch": "widen", "disown": "narrow"}[play]


def _run(peers: dict[str, tuple[str, int, float | None]], busy: tuple[str, ...], donor: str) -> StageParts:
    """A joiner's download from ``donor`` first (then any other); ``peers``: id -> (kind,
    index, partner spread reported)."""
    parts = {p: _peer(kind, index) for p, (kind, index, _) in peers.items()}
    stage = Stage(parts, busy=busy)
    for p, (_, _, spread) in peers.items():
        if spread is not None:
            numel = len(parts[p].worker.params)
            stage.witnesses[p].partner_spread = lambda s=spread, n=numel: [s] * n
    node = joiner(stage, parts, prefer=donor, rng=random.Random(0))
    # the sketch seeds, drawn alike each run
    with mock.patch("secrets.randbelow", random.Random(0).randrange):
        vclock.run(node.sync.download())
    return node


def poisoned_adopted(size: int, colluders: int, busy: int, play: str) -> bool:
    """A stage of ``size``: a colluding donor QmL0 with ``colluders - 1`` colluding
    witnesses, the rest honest, ``busy`` of them kept busy. Whether the joiner adopts a
    colluder's state."""
    peers = {"QmL0": ("poisoned", 0, None)}
    for name, kind, spread in _colluders(colluders - 1, play, "vouch"):
        peers[name] = (kind, int(name[3:]), spread)
    honest = [f"QmH{i}" for i in range(size - colluders)]
    peers.update({h: ("honest", i, None) for i, h in enumerate(honest)})
    node = _run(peers, tuple(honest[:busy]), "QmL0")
    return (node.stats.downloaded_from or "").startswith("QmL")


def honest_banned(size: int, colluders: int, busy: int, play: str) -> bool:
    """A stage of ``size``: an honest donor QmH0, ``colluders`` colluding witnesses, the
    rest honest, ``busy`` of the honest witnesses kept busy. Whether the joiner bans an
    honest peer."""
    peers = {name: (kind, int(name[3:]), spread) for name, kind, spread in _colluders(colluders, play,
                                                                                      "disown")}
    honest = [f"QmH{i}" for i in range(size - colluders)]
    peers.update({h: ("honest", i, None) for i, h in enumerate(honest)})
    node = _run(peers, tuple(honest[1:1 + busy]), "QmH0")
    return any(node.guard.is_poisoned(h) for h in honest)


def held_up(size: int, busy: int) -> bool:
    """An honest stage of ``size``, ``busy`` of the witnesses of the first donor kept
    busy: whether its state is not adopted."""
    honest = [f"QmH{i}" for i in range(size)]
    node = _run({h: ("honest", i, None) for i, h in enumerate(honest)}, tuple(honest[1:1 + busy]), "QmH0")
    return node.stats.downloaded_from != "QmH0"


@dataclass(frozen=True)
class Row:
    size: int
    poison: int | None  # fewest colluding identities (donor included) that get a poisoned state adopted
    poison_busy: int | None  # the same, with any number of honest witnesses kept busy
    frame: int | None  # fewest colluding witnesses that get an honest donor banned
    frame_busy: int | None
    hold_up: int | None  # fewest busy witnesses that keep an honest donor's state from being adopted


def _fewest(counts: range, wins) -> int | None:
    return next((c for c in counts if wins(c)), None)


def row(size: int) -> Row:
    def poison(c: int, busy: range) -> bool:
        return any(poisoned_adopted(size, c, b, play) for b in busy for play in POISON_PLAYS)

    def frame(c: int, busy: range) -> bool:
        return any(honest_banned(size, c, b, play) for b in busy for play in FRAME_PLAYS)

    return Row(size,
               poison=_fewest(range(1, size + 1), lambda c: poison(c, range(1))),
               poison_busy=_fewest(range(1, size + 1), lambda c: poison(c, range(size - c + 1))),
               frame=_fewest(range(size), lambda c: frame(c, range(1))),
               frame_busy=_fewest(range(size), lambda c: frame(c, range(size - c))),
               hold_up=_fewest(range(size), lambda b: held_up(size, b)))


def markdown(rows: list[Row]) -> str:
    def cell(v: int | None) -> str:
        return "never" if v is None else str(v)

    lines = ["| peers in the stage | a poisoned state adopted: colluders, donor included | the same, "
             "honest witnesses kept busy | an honest donor banned: colluding witnesses | the same, honest "
             "witnesses kept busy | busy witnesses that hold up an honest donor's state |",
             "|---|---|---|---|---|---|"]
    lines += [
        f"| {r.size} | {cell(r.poison)} | {cell(r.poison_busy)} | {cell(r.frame)} | {cell(r.frame_busy)} "
        f"| {cell(r.hold_up)} |"
        for r in rows
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(markdown([row(size) for size in SIZES]))

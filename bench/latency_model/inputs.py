"""Measured inputs of the latency model, read from other benchmarks' result files.

- ``sync_cost.json``: ``summary["message_time_s"][setting][str(params)]``, the median
  seconds for one (phi, Delta) frame to reach a peer; ``summary["allreduce_over_pair"]
  [setting][str(params)][str(N)]``, hivemind all-reduce round / pair round at small N.
- ``swarm_efficiency.json``: ``summary["step_time_s"]`` = {"mean", "std", "n", "layout"},
  the inner-step time of a local swarm's nodes.

A leaf may be a number (a typical time, spread unknown), {"mean", "std"} (or "mean_s",
"std_s"), or a list of samples; anything else is skipped. Nothing here invents a number:
an input without a spread keeps ``std = None``."""

from __future__ import annotations

import statistics
from collections.abc import Iterator


def leaves(value, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], object]]:
    """(path of keys, leaf) for nested dicts; a dict with a "mean" is a leaf, not a level."""
    if isinstance(value, dict) and not {"mean", "mean_s"} & value.keys():
        for key, sub in value.items():
            yield from leaves(sub, (*path, str(key)))
    else:
        yield path, value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def mean_std(leaf) -> tuple[float, float | None] | None:
    """(mean, std or None) of one leaf; None when it is not a positive time."""
    if _is_number(leaf):
        return (float(leaf), None) if leaf > 0 else None
    if isinstance(leaf, dict):
        mean, std = leaf.get("mean", leaf.get("mean_s")), leaf.get("std", leaf.get("std_s"))
        if not (_is_number(mean) and mean > 0):
            return None
        return float(mean), (float(std) if _is_number(std) and std >= 0 else None)
    if isinstance(leaf, list) and len(leaf) >= 2 and all(_is_number(v) for v in leaf):
        mean = statistics.fmean(leaf)
        return (mean, statistics.stdev(leaf)) if mean > 0 else None
    return None


def summary_times(result: dict | None, key: str) -> dict[tuple[str, ...], tuple[float, float | None]]:
    """{path: (mean_s, std_s or None)} for every readable leaf of ``result["summary"][key]``."""
    value = (result or {}).get("summary", {}).get(key)
    found = {path: mean_std(leaf) for path, leaf in leaves(value)} if value is not None else {}
    return {path: stats for path, stats in found.items() if stats is not None}


def label(path: tuple[str, ...], fallback: str = "all") -> str:
    return " / ".join(path) or fallback


def largest_per_setting(times: dict[tuple[str, ...], tuple[float, float | None]]) -> dict:
    """The slowest message of each setting (its biggest stage measured): one input per network setting."""
    best: dict[str, tuple[tuple[str, ...], tuple[float, float | None]]] = {}
    for path, stats in times.items():
        setting = path[0] if path else "all"
        if setting not in best or stats[0] > best[setting][1][0]:
            best[setting] = (path, stats)
    return dict(best.values())


def small_n_ratios(result: dict | None) -> list[dict]:
    """Measured all-reduce / pair round times at small N: [{"label", "n_peers", "measured"}]."""
    value = (result or {}).get("summary", {}).get("allreduce_over_pair") or {}
    return [{"label": label(path[:-1]), "n_peers": int(path[-1]), "measured": float(leaf)}
            for path, leaf in leaves(value) if _is_number(leaf) and path and path[-1].isdigit()]


def source_note(name: str, key: str, result: dict | None, found: bool, default: str) -> str:
    """One line saying where an input came from, or that the paper's default stands alone."""
    if result is None:
        return f"bench/results/{name}.json is absent: no measured {key}; {default} stand alone."
    if not found:
        return (f"bench/results/{name}.json ({result.get('mode')}, {result.get('started')}) has no readable "
                f"summary[\"{key}\"]: {default} stand alone.")
    return (
        f"{key} measured by bench/results/{name}.json ({result.get('mode')} mode, {result.get('started')})."
    )

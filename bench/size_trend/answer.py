"""The size trend's one-paragraph answer, from the benchmark's rows: how NoLoCo's gap to
DiLoCo moves with the model's size, against the spread over seeds, and what moves NoLoCo
(the ablations, each at the largest size that has run it on every method it concerns)."""

from __future__ import annotations

from bench.size_trend.plan import LOW_ALPHA


def answer(trend: list[dict], sizes: list[dict] = (), ablations: list[dict] = ()) -> str:
    """The one-paragraph answer, from the trend rows (in size order); the size rows say
    what every size trains on, the ablation rows what moves NoLoCo."""
    ratio = [r for r in trend if r["against"] == "paper ratio" and "alpha" not in r["noloco"]]
    low = [r for r in trend if r["against"] == "paper ratio" and "alpha" in r["noloco"]]
    if not ratio:
        return "No size has both NoLoCo and DiLoCo runs yet."

    def at_each(rows: list[dict]) -> str:
        def seeds(r: dict) -> str:
            return f"sd {r['sd']:.2f}, {r['seeds']} seeds" if r["seeds"] > 1 else "one seed"

        return ", ".join(
            f"{r['noloco_over_diloco_pct']:+.2f} % ({seeds(r)}) at {r['body_parameters'] / 1e6:.2f}M"
            for r in rows
        )

    caveat = (
        "One seed, so no spread: these numbers smoke-test the benchmark and are no evidence either way. "
        if max(r["seeds"] for r in ratio) < 2
        else ""
    )
    low_text = (f"; with outer momentum {LOW_ALPHA:g}, NoLoCo's is {at_each(low)}" if low else "")
    measured = (f"{caveat}At the paper's H ratio, NoLoCo's loss over DiLoCo's is {at_each(ratio)} parameters "
                f"outside the embeddings{low_text}.")
    if len(ratio) == 1:
        return f"{measured} One size shows no trend; the answer needs the larger sizes' runs."
    first, last = ratio[0], ratio[-1]
    # a size on one seed (the largest, until its other seeds have run: plan.deferred) has
    # no spread of its own; the seeds of the sizes that have them stand in for it
    spread = max(r["sd"] for r in ratio + low if r["seeds"] > 1 or r["model"] in (first["model"],
                                                                                  last["model"]))
    borrowed = [r for r in ratio if r["seeds"] < 2]
    if borrowed and not caveat:
        them = "them" if len(borrowed) > 1 else "it"
        measured += (
            f" {' and '.join(r['model'] for r in borrowed)} on one seed so far: the spread beside {them} is "
            f"the other sizes' (sd up to {spread:.2f})."
        )
    paper_verdict, paper_ahead = _trend(ratio, spread)
    text = (
        f"{measured} From the smallest size to the largest the gap at the paper's settings {paper_verdict}; "
        f"at the largest size NoLoCo with them is {paper_ahead}."
    )
    if len(low) > 1:
        low_verdict, low_ahead = _trend(low, spread)
        text += (f" With outer momentum {LOW_ALPHA:g} the gap {low_verdict}; "
                 f"at the largest size NoLoCo is {low_ahead}.")
    return (text + _budget(sizes, [first["model"], last["model"]])
            + _what_moves_noloco(ablations, spread, [r["model"] for r in ratio]))


def _what_moves_noloco(ablations: list[dict], spread: float, size_order: list[str]) -> str:
    """Each ablation at the largest size that has run it on every method it concerns (the
    plan runs the largest size's ablations last; until then a smaller size's figures
    stand, not a mix of sizes): NoLoCo's own settings that move it beyond the spread over
    seeds (the largest size first, then the largest change), and the ablations run on
    several methods with each method's change, so one that moves every method alike is
    not read as NoLoCo's gap."""
    sizes = list(dict.fromkeys([*size_order, *(r["model"] for r in ablations)]))
    # ablation -> size -> the methods that ran it there, in plan order
    ran: dict[str, dict[str, set[str]]] = {}
    for r in ablations:
        ran.setdefault(r["ablation"], {}).setdefault(r["model"], set()).add(r["method"])
    at = {label: max(by_size, key=lambda size: (by_size[size] == set().union(*by_size.values()),
                                                sizes.index(size)))
          for label, by_size in ran.items()}  # ablation -> the size its figures are read at
    kept = [r for r in ablations if at[r["ablation"]] == r["model"]]
    shared = dict.fromkeys(r["ablation"] for r in kept if r["method"] != "noloco")
    own = [r for r in kept if r["method"] == "noloco" and r["ablation"] not in shared]
    own_sizes = sorted({r["model"] for r in own}, key=sizes.index, reverse=True)
    moved = {size: sorted((r for r in own if r["model"] == size and abs(r["change_pct"]) > spread),
                          key=lambda r: -abs(r["change_pct"])) for size in own_sizes}
    against = "first seed, against its run at the paper's settings, beyond the spread"
    if not any(moved.values()):
        text = (
            f" None of NoLoCo's settings moves it at {' or '.join(own_sizes)} beyond the spread over seeds."
            if own
            else ""
        )
    elif len(own_sizes) == 1:
        text = (
            f" What moves NoLoCo at {own_sizes[0]} ({against}): {_changes(moved[own_sizes[0]], 'ablation')}."
        )
    else:
        each = "; ".join(f"at {size} {_changes(rows, 'ablation')}" for size, rows in moved.items() if rows)
        text = f" What moves NoLoCo ({against}; each setting at the largest size that has run it): {each}."
    if shared:
        where = len(set(at.values())) > 1  # name the size only where they differ
        each = "; ".join(
            f"{label}{' at ' + at[label] if where else ''} "
            f"{_changes([r for r in kept if r['ablation'] == label], 'method')}"
            for label in shared
        )
        text += f" Run on every method it concerns: {each}."
    return text


def _changes(rows: list[dict], name: str) -> str:
    return ", ".join(f"{r[name]} {r['change_pct']:+.2f} %" for r in rows)


def _budget(sizes: list[dict], ends: list[str]) -> str:
    """Every size trains on the same tokens, so the larger ones on fewer per parameter:
    the trend is the model's size and its training length together."""
    per_param = {r["model"]: r["tokens_per_parameter"] for r in sizes}
    if not all(m in per_param for m in ends):
        return ""
    return (
        f" Every size trains on the same {sizes[0]['tokens'] / 1e6:.1f}M tokens, {per_param[ends[0]]:.1f} a "
        f"parameter at the smallest and {per_param[ends[1]]:.1f} at the largest: the trend is of size and "
        f"training length together."
    )


def _trend(rows: list[dict], spread: float) -> tuple[str, str]:
    """Whether NoLoCo's gap to DiLoCo (``rows`` in size order) moves from the first size
    to the last by more than ``spread``, and where the last stands."""
    first, last = rows[0]["noloco_over_diloco_pct"], rows[-1]["noloco_over_diloco_pct"]
    verdict = ("shrinks as the model grows" if last < first - spread else "grows with the model"
               if last > first + spread else "does not change beyond the spread over seeds")
    last_sd = rows[-1]["sd"] if rows[-1]["seeds"] > 1 else spread
    ahead = ("behind DiLoCo" if last > last_sd else "ahead of DiLoCo" if last < -last_sd
             else "level with DiLoCo, within the spread")
    return verdict, ahead

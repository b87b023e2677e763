"""Whether a downloaded state is one of its stage's replicas (docs/ALGORITHM.md section 8).

A joiner holds a candidate state (theta, phi, outer momentum, counters) from a donor it
picked at random, and sketches (state/sketch.py) that other live peers of the stage,
the witnesses, made of their own states under a seed the joiner drew after the download.
Each witness votes; the donor's own state counts as one more vote for it (replicas
that kept pairing among themselves drift apart as groups: a donor and its group-mates
against the rest is a tie, and ties stand). Who decides is below; a vote compares:

- phi, against the witness's moved by its own momentum between 4 rounds back and 4 ahead
  (the round before its last outer step is exact for heavy-ball momentum), whichever is
  closest, since the states were taken up to a download apart and honest replicas drift
  rounds apart with their pace; within the tolerance ``max(SPREAD_K * D, MOTION_K * m,
  EPS * |phi|)``, as a whole and per tensor (each tensor with its own D, m and |phi|,
  times TENSOR_SLACK for the sketch's noise). D is the honest spread as measured now,
  from the distances between witnesses and between each witness and its recent partners
  as it counted them, taken so that witnesses lying about either cannot widen it while
  they are fewer than half of the witnesses asked (_Tolerance.of). m is the witnesses'
  lower median momentum norm: one round's motion. The spread alone would refuse honest
  states when the stage has just averaged itself into one point (a DiLoCo round, two
  replicas that always pair); the motion alone would let noise through when replicas
  sit far apart.
- the outer momentum and theta - phi (the progress in the round), by norm: the momentum
  at most NORM_K times the witnesses' lower median (or a round of their progress, before
  their first outer step), the progress per inner step of the round at most NORM_K
  times the largest an honest witness has (trimmed like the spread: one colluding
  witness claiming a huge progress must not widen it), or one round's motion in all (an
  overlapped round starts its steps from the local outer step). Replicas' values differ
  too much in direction to compare them point by point; the norm bounds what a liar
  can hide there to about what an honest partner may send in a round
  (gossip/partner_check.py clips those at 1.5x). Per step, because early in warm-up the
  progress grows with the square of the steps and replicas are steps apart.

The counters (inner step, outer round) are not evidence: an honest stage's drift apart
with each peer's pace and join history (rounds apart are usual). The joiner adopts the
donor's, within the range the witnesses' honest majority spans (a robust range, like
the spread).

Who decides (the panel is the donor and every witness asked): a witness that was asked
and gave no usable sketch (busy, timed out, refused, unusable) is silent. Silence never
helps a donor's state in (it counts against adopting it: keeping honest witnesses busy
buys no state) and never gets a donor banned (it counts for the donor there). The state
is adopted when at least one witness agrees and the donor with the agreeing witnesses
is at least half of the panel. A refused donor is banned as a poisoner only on an
honest majority's evidence: at least two witnesses within OUT_OF_STEP_ROUNDS of the
donor's round that disown the state even on the widest bounds any voter gives (which
no colluder can narrow; past the alignment's reach, widened by a round's motion a
round), more than the rest of the panel together. Otherwise a refusal bans nobody.

What this does not stop: colluding identities that make up half of the panel (its
donor among them) and one of them a witness, whoever else answers or is kept busy; a
strict majority of in-step witnesses colluding gets an honest donor banned (the table
in docs/ALGORITHM.md 8). A state within the tolerance of the honest spread is adopted:
by construction it is as close to the others as they are to each other."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from swarm_node.state.sketch import StateSketch

SPREAD_K = 1.5
MOTION_K = 2.0  # two rounds of motion: phi aligned a round apart, and a round of honest drift
NORM_K = 3.0
TENSOR_SLACK = 2.0  # a tensor's distance from its sketch: relative error about sqrt(2 / buckets)
# A vote aligns the candidate with the witness's phi moved along the witness's momentum by
# up to 4 rounds either way: honest replicas drift rounds apart with their pace (a
# stage-0 donor 3 rounds ahead of the only other honest peer sat at 2.26 times the
# tolerance from its phi, in the multi-host test of hostile donors), and phi moves about
# its momentum a round. What a liar gains: a state up to 4 rounds along the witness's own
# course is taken as on it. The tolerance itself is not widened: widened by a round's
# motion per round apart, it let a state with one tensor replaced through in that test.
ALIGNED_ROUNDS = range(-4, 5)
EPS = 1e-5  # floating-point noise, relative to |phi|: replicas at round 0 share the initial weights


# A witness more rounds than this from the donor's claimed round is no evidence for a
# ban: its vote compares states too far apart along the course to mean much (a joiner
# that adopted nothing, a peer left 15-50 rounds behind). Nearer, but beyond the
# alignment's reach, a dissent is evidence only outside the widest bounds widened by a
# round's motion per round past that reach: an honest peer that held its round for a
# while is that many rounds behind, along the course (ALGORITHM.md 8). The reach alone
# would not do: honest witnesses span rounds around a liar's claim.
OUT_OF_STEP_ROUNDS = 2 * max(ALIGNED_ROUNDS)


@dataclass(frozen=True)
class Witness:
    """A peer's sketch of its own state, and the largest distance (per tensor) between
    its phi and a recent partner's, as it counted it (None: no partner yet)."""
    sketch: StateSketch
    partner_spread: torch.Tensor | None = None


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    why: str  # one line: the votes, or why nobody could vote
    agree: int = 0
    disagree: int = 0
    distance_ratio: float = 0.0  # the candidate's phi distance over the tolerance, at the closest witness
    unanswered: bool = False  # witnesses were asked and none answered: no verdict on the donor
    poisoner: bool = False  # refused on an honest majority's evidence: the donor may be banned
    silent: int = 0  # witnesses asked that gave no usable sketch
    # the counters to adopt: the donor's, within the witnesses' (an honest stage's counters
    # drift apart with pace and join history, so they are no ground for refusing; a liar's
    # 100,000 extra steps would move the learning-rate schedule)
    inner_step: int | None = None
    outer_round: int | None = None

    @property
    def checked(self) -> bool:
        return self.agree + self.disagree > 0


def liars_among(asked: int) -> int:
    """Witnesses that may lie, of ``asked``: fewer than half."""
    return (asked - 1) // 2


def check_state(candidate: StateSketch, witnesses: Mapping[str, Witness], *, inner_steps: int,
                asked: int | None = None) -> Verdict:
    """The verdict on ``candidate`` from ``witnesses`` (peer id -> what it said);
    ``asked``: the witnesses asked (those not in ``witnesses`` are silent; default: as
    many as answered); ``inner_steps``: H, the inner steps of a round.

    A witness agrees when the candidate is within the tolerance robust to ``liars`` of
    the witnesses asked (no fewer colluders can widen it: what lets a state in), and
    disowns it when the candidate is outside even the widest any voter's numbers give
    (no colluder can narrow that: what gets a donor banned); between, it is unsure."""
    asked = len(witnesses) if asked is None else max(asked, len(witnesses))
    if not asked:
        return Verdict(True, "no other peer of the stage to compare with", inner_step=candidate.inner_step,
                       outer_round=candidate.outer_round)
    silent = asked - len(witnesses)
    if not witnesses:  # asked but nobody answered (busy, or kept busy): no verdict either way
        return Verdict(False, f"none of the {asked} other peers of the stage answered for it",
                       unanswered=True, silent=silent)
    voters = list(witnesses.values())
    liars = liars_among(asked)
    tolerance = _Tolerance.of(voters, inner_steps, liars)
    widest = _Tolerance.of(voters, inner_steps, 0, widest=True)
    agreeing, ratios, failed, disown = [], [], Counter(), 0
    for w in voters:
        ratio, outside = tolerance.vote(candidate, w.sketch, inner_steps)
        if not outside:
            agreeing.append(w)
        ratios.append(ratio)
        failed.update(outside)
        # a witness far from the donor's round is no evidence to ban on (module docstring)
        if outside and abs(w.sketch.outer_round - candidate.outer_round) <= OUT_OF_STEP_ROUNDS:
            past_reach = max(0, abs(w.sketch.outer_round - candidate.outer_round) - max(ALIGNED_ROUNDS))
            disown += bool(widest.vote(candidate, w.sketch, inner_steps, rounds_past_reach=past_reach)[1])
    agree = len(agreeing)
    disagree = len(voters) - agree
    # the donor's own state is one more vote for it; a silent witness is none
    accepted = agree >= 1 and 1 + agree >= disagree + silent
    poisoner = not accepted and disown >= 2 and disown > asked + 1 - disown
    steps = [w.sketch.inner_step for w in voters]
    rounds = [w.sketch.outer_round for w in voters]
    leaning = "" if len(voters) != 2 or liars else _on_the_others_bounds(candidate, agreeing, inner_steps)
    why = (f"{agree} of {len(voters)} peers agree{leaning}"
           + (f", {silent} of {asked} asked silent" if silent else "")
           + f" (phi at {min(ratios):.2f} of the tolerance at the closest; "
           f"spread {_whole(tolerance.spread):.3g}, a round's motion {_whole(tolerance.motion):.3g}"
           + (f"; outside: {', '.join(f'{bound} {n}x' for bound, n in sorted(failed.items()))}; "
              f"round {candidate.outer_round} against {min(rounds)}-{max(rounds)}" if failed else "") + ")")
    return Verdict(accepted, why, agree, disagree, min(ratios), poisoner=poisoner, silent=silent,
                   inner_step=_within_range(candidate.inner_step, steps, liars),
                   outer_round=_within_range(candidate.outer_round, rounds, liars))


def _on_the_others_bounds(candidate: StateSketch, agreeing: list[Witness], inner_steps: int) -> str:
    """With two witnesses (none trimmed) the distance between them is the only one
    there is, and either sets it for the other's vote: the verdict's line says how many
    agreed only within bounds the other's numbers gave (one colluding witness can make
    the other agree with anything; with the donor's vote the two colluders win such a
    stage anyway, but the line must not read as two witnesses vouching)."""
    leaning = sum(bool(_Tolerance.of([w], inner_steps, 0).vote(candidate, w.sketch, inner_steps)[1])
                  for w in agreeing)
    return f", {leaning} of them only within the other's bounds" if leaning else ""


def _within_range(claimed: int, values: list[int], liars: int) -> int:
    """``claimed`` clamped to the range the honest among ``values`` span when up to
    ``liars`` of them lie: from the (liars + 1)-th smallest to the (n - liars)-th (one
    colluding witness claiming 10^12 steps must not set the adopted counter)."""
    ordered = sorted(values)
    high = ordered[max(1, len(ordered) - liars) - 1]
    low = min(ordered[min(len(ordered), liars + 1) - 1], high)
    return min(max(claimed, low), high)


def _kth_smallest(values: Sequence[torch.Tensor], k: int) -> torch.Tensor:
    """Element-wise k-th smallest (1-based)."""
    return torch.stack(list(values)).sort(dim=0).values[k - 1]


def _apart(candidate: StateSketch, witness: StateSketch, rounds: range = range(-1, 1)) -> torch.Tensor:
    """Per tensor, the distance between the candidate's phi and the witness's moved by its
    own momentum ``k`` rounds (``k`` in ``rounds``; -1: its phi before its last outer step),
    whichever is closest as a whole: the two states were taken up to a download apart, a
    round may have closed in between, and replicas drift rounds apart with their pace.
    Only the witness's own momentum moves it (a donor's would be its to choose)."""
    best = None
    for k in rounds:
        apart = _tensor_norms(candidate.phi - (witness.phi + k * witness.momentum))
        if best is None or _whole(apart) < _whole(best):
            best = apart
    return best


def _tensor_norms(rows: torch.Tensor) -> torch.Tensor:
    return rows.norm(dim=-1)


def _whole(per_tensor: torch.Tensor) -> float:
    return float(per_tensor.pow(2).sum().sqrt())


@dataclass(frozen=True)
class _Tolerance:
    """The scales every vote is held to, per tensor (the whole's is their root sum of squares)."""
    spread: torch.Tensor  # D: the largest honest distance seen
    motion: torch.Tensor  # m: one round's motion of phi
    phi: torch.Tensor  # |phi|
    progress_rate: torch.Tensor  # an honest witness's largest theta - phi per inner step of its round

    @classmethod
    def of(cls, voters: list[Witness], inner_steps: int, liars: int, *, widest: bool = False) -> _Tolerance:
        """Robust to ``liars`` of the voters (fewer than half of the witnesses asked)
        lying about their states or their partners: of the distances between two
        witnesses, the largest that the honest ones alone would have (the C(n - liars,
        2)-th smallest); of the partner spreads and the progress rates, the
        (n - liars)-th smallest; of the momentum and phi norms, the lower median, or that
        when fewer answered. With no more voters than liars (the rest silent), the
        smallest. (The largest of all let one colluding witness, far from the rest, widen
        the tolerance for its donor.)
        ``widest``: the largest of each, which no voter can narrow."""
        honest = len(voters) - liars
        k = max(1, honest)
        median = len(voters) if widest else min((len(voters) + 1) // 2, k)
        between = [_apart(a.sketch, b.sketch) for i, a in enumerate(voters) for b in voters[i + 1:]]
        spread = torch.zeros(voters[0].sketch.phi.shape[0])
        # a witness with no partner yet counts as 0, so a liar's claim alone is trimmed too
        partners = [spread if w.partner_spread is None else w.partner_spread for w in voters]
        if between and honest >= 2:
            spread = torch.maximum(spread, _kth_smallest(between, math.comb(honest, 2)))
        spread = torch.maximum(spread, _kth_smallest(partners, k))
        motion = _kth_smallest([_tensor_norms(w.sketch.momentum) for w in voters], median)
        progress_rate = _kth_smallest([_tensor_norms(w.sketch.progress) / max(1, w.sketch.round_steps)
                                       for w in voters], k)
        if _whole(motion) == 0:  # before the witnesses' first outer step: a round's progress stands for it
            motion = inner_steps * progress_rate
        phi = _kth_smallest([_tensor_norms(w.sketch.phi) for w in voters], median)
        return cls(spread=spread, motion=motion, phi=phi, progress_rate=progress_rate)

    def _phi_bound(self, rounds_past_reach: int = 0) -> torch.Tensor:
        bound = torch.maximum(torch.maximum(SPREAD_K * self.spread, MOTION_K * self.motion), EPS * self.phi)
        return bound + rounds_past_reach * self.motion

    def vote(self, candidate: StateSketch, witness: StateSketch, inner_steps: int,
             rounds_past_reach: int = 0) -> tuple[float, list[str]]:
        """The phi distance over its bound, and the bounds ``candidate`` is outside of as
        ``witness`` sees it (none: the witness agrees); ``rounds_past_reach``: rounds
        between them beyond the alignment's, each widening the phi bound by a round's motion."""
        apart = _apart(candidate, witness, ALIGNED_ROUNDS)
        bound = self._phi_bound(rounds_past_reach)
        ratio = _whole(apart) / max(_whole(bound), 1e-30)
        per_tensor = bool((apart <= TENSOR_SLACK * bound).all())
        # a round's motion, or before the witnesses' first outer step (the candidate a round
        # ahead of them) a round's progress: an outer step moves about as far as the steps did
        momentum_ok = _within(_tensor_norms(candidate.momentum),
                              NORM_K * torch.maximum(self.motion, inner_steps * self.progress_rate), self.phi)
        steps = min(max(1, candidate.round_steps), inner_steps)
        progress_ok = _within(_tensor_norms(candidate.progress),
                              torch.maximum(NORM_K * steps * self.progress_rate, NORM_K * self.motion),
                              self.phi)
        checks = {"phi": ratio <= 1.0, "phi per tensor": per_tensor, "momentum": momentum_ok,
                  "progress": progress_ok}
        return ratio, [bound for bound, ok in checks.items() if not ok]


def _within(norms: torch.Tensor, bound: torch.Tensor, phi: torch.Tensor) -> bool:
    """Norms within ``bound``, as a whole and (with the sketch's slack) per tensor."""
    bound = torch.maximum(bound, EPS * phi)
    if not math.isfinite(_whole(norms)):
        return False
    return _whole(norms) <= _whole(bound) and bool((norms <= TENSOR_SLACK * bound).all())

"""The state check's claim, restated with figures and held to them: for stages of 2, 3,
5 and 9 peers, the fewest colluding identities that get a poisoned state adopted or an
honest donor banned, with no honest witness busy and with any number kept busy, and
the fewest busy witnesses that hold up an honest state, found by running the check for
every number of each (tests/inproc/state_claim.py); docs/ALGORITHM.md 8 prints this
table."""

from pathlib import Path

import pytest
from state_claim import SIZES, Row, markdown, row

CLAIM = {2: Row(2, poison=2, poison_busy=2, frame=None, frame_busy=None, hold_up=1),
         3: Row(3, poison=2, poison_busy=2, frame=2, frame_busy=2, hold_up=2),
         5: Row(5, poison=3, poison_busy=3, frame=4, frame_busy=3, hold_up=3),
         9: Row(9, poison=5, poison_busy=5, frame=8, frame_busy=5, hold_up=5)}


@pytest.mark.parametrize("size", [2, 3, 5, pytest.param(9, marks=pytest.mark.slow)])
def test_what_it_takes_to_beat_the_check(size):
    assert row(size) == CLAIM[size]


def test_the_documented_table_is_the_claim():
    algorithm = (Path(__file__).parents[2] / "docs" / "ALGORITHM.md").read_text()
    assert markdown([CLAIM[size] for size in SIZES]) in algorithm


def test_no_minority_of_colluders_wins_however_many_witnesses_are_busy():
    """The rule the table bears out: a poisoned state needs colluders making up half of
    the stage (and one of them a witness), a ban needs colluding witnesses outnumbering
    the rest of the stage; busy witnesses never lower either."""
    for size, claim in CLAIM.items():
        assert claim.poison == claim.poison_busy == max(2, (size + 1) // 2)
        assert claim.frame_busy is None or claim.frame_busy == size // 2 + 1
        assert claim.frame is None or claim.frame >= claim.frame_busy

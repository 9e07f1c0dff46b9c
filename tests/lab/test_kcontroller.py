"""The k controller's offline replay (lab.kcontroller)."""
from __future__ import annotations

import numpy as np
import pytest


def test_kcontroller_replay_counts_rounds_as_the_drafter_runs_them():
    """lab.kcontroller.replay on 13 positions that the draft always guesses,
    k = 3, exact costs: rounds at h = 1, 5, 9 (4 tokens each), the first feeding the
    draft 1 token and the later ones 2 (the last draft and the target's bonus token)."""
    from lab.kcontroller import replay
    match = [np.ones(13, bool)]
    V = {2: 1.2, 3: 1.3, 4: 1.5}
    r = replay(3, match, V.get, 0.25, 0.3, seed=0, noise=0.0, drift=0.0, gens=1)
    rounds = (0.25 + 2 * 0.25 + 1.5) + 2 * (0.3 + 2 * 0.25 + 1.5)
    assert r == pytest.approx(12 / rounds)
    # the adaptive controller on 129 such positions: drafting pays, and long drafts
    # (cheap extra rows, every draft accepted) beat k = 3
    long = [np.ones(129, bool)]
    cheap = lambda rows: 1.0 + 0.15 * (rows - 1)
    adaptive = replay("adaptive", long, cheap, 0.25, 0.3, seed=1, noise=0.05, drift=0.01)
    assert adaptive > replay(3, long, cheap, 0.25, 0.3, seed=1, noise=0.05, drift=0.01) > 1.5

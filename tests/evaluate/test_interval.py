"""Bootstrap intervals of the acceptance length over prompts (eyrie.evaluate.interval)."""

from __future__ import annotations

import random

import pytest

from eyrie.evaluate.interval import al_interval, prompts_for, ratio_interval


def counts(n: int, low: int, high: int, seed: int, drafts: int = 12) -> list[tuple[int, int]]:
    r = random.Random(seed)
    return [(drafts, r.randint(low, high)) for _ in range(n)]


def test_the_interval_holds_the_al_and_narrows_as_one_over_root_n():
    """Around vLLM's AL of all prompts; the same prompts four times over: about half as wide."""
    few = counts(20, 2, 20, seed=1)
    al = 1 + sum(a for _, a in few) / sum(d for d, _ in few)
    low, high = al_interval(few)
    assert low < al < high
    low4, high4 = al_interval(few * 4)
    assert (high4 - low4) / (high - low) == pytest.approx(0.5, abs=0.1)


def test_a_draft_against_itself_is_a_ratio_of_one_exactly():
    """Paired: the same prompts drawn for both, so a draft compared with itself has no spread."""
    same = counts(16, 0, 30, seed=2)
    got = ratio_interval(same, same)
    assert got == {"ratio": 1.0, "ci95": [1.0, 1.0], "prompts_for_3pct": 16}


def test_pairing_removes_what_the_prompts_share():
    """Two drafts whose AL differs by the same factor on prompts of very different difficulty:
    the paired ratio's interval is far narrower than either draft's own interval."""
    r = random.Random(3)
    hard = [r.choice([1, 10]) for _ in range(30)]  # accepted tokens per draft, per prompt
    second = [(100, 100 * h // 10) for h in hard]
    first = [(100, 100 * h // 10 + 10 + r.randint(0, 2)) for h in hard]
    ratio = ratio_interval(first, second)
    low, high = ratio["ci95"]
    own_low, own_high = al_interval(first)
    assert low < ratio["ratio"] < high
    assert (high - low) / ratio["ratio"] < 0.2 * (own_high - own_low) / ((own_high + own_low) / 2)


def test_the_prompts_needed_for_three_percent():
    assert prompts_for(2.0, [1.8, 2.2], 100) == 1112  # half-width 10%: (10/3)^2 x 100, up
    assert prompts_for(2.0, [1.98, 2.02], 100) == 100  # already within 3%
    assert prompts_for(2.0, None, 100) is None


def test_no_prompts_no_interval_and_other_prompts_refused():
    assert al_interval([]) is None and ratio_interval([], []) is None
    with pytest.raises(ValueError, match="not the same prompts"):
        ratio_interval([(1, 1)], [(1, 1), (1, 0)])

"""How sure an acceptance length is: percentile bootstrap intervals over prompts.

A prompt's drafts are not independent (one prompt's text is easy or hard for every draft of it),
so the unit resampled is the prompt: each replicate draws the evaluation's prompts with
replacement and recomputes vLLM's AL, 1 + accepted / drafts over the drawn prompts. Two drafts
decoded on the same prompts are compared by the ratio of their ALs, resampling the prompts once
for both (paired): what one prompt's difficulty adds to both cancels. `prompts_for` says how
many prompts would bring the ratio's interval to a given half-width, from the interval's
1/sqrt(n) scaling.
"""

from __future__ import annotations

import math

import torch

REPLICATES = 2000
SEED = 0  # the same prompts drawn for every report: an interval is reproducible


def _al(counts: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """AL of each replicate: counts [n, 2] (drafts, accepted) per prompt, draws [R, n] indices."""
    drafts, accepted = counts[draws].unbind(-1)  # [R, n] each
    total = drafts.sum(-1)
    return torch.where(total > 0, 1 + accepted.sum(-1) / total.clamp(min=1), torch.nan)


def _draws(n: int, replicates: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(n, (replicates, n), generator=g)


def _interval(values: torch.Tensor) -> list[float] | None:
    values = values[~values.isnan()]
    if values.numel() == 0:
        return None
    lo, hi = torch.quantile(values, torch.tensor([0.025, 0.975], dtype=values.dtype)).tolist()
    return [lo, hi]


def al_interval(
    per_prompt: list[tuple[int, int]], replicates: int = REPLICATES, seed: int = SEED
) -> list[float] | None:
    """95% interval [low, high] of the AL of (drafts, accepted tokens) per prompt; None with no
    drafts."""
    if not per_prompt:
        return None
    counts = torch.tensor(per_prompt, dtype=torch.float64)
    return _interval(_al(counts, _draws(len(per_prompt), replicates, seed)))


def ratio_interval(
    first: list[tuple[int, int]],
    second: list[tuple[int, int]],
    replicates: int = REPLICATES,
    seed: int = SEED,
) -> dict | None:
    """The AL of `first` over that of `second`, both decoded on the same prompts (in the same
    order): {"ratio", "ci95", "prompts_for_3pct"} with a paired bootstrap; None without drafts."""
    if len(first) != len(second):
        raise ValueError(f"{len(first)} and {len(second)} prompts: not the same prompts")
    if not first:
        return None
    a, b = (torch.tensor(x, dtype=torch.float64) for x in (first, second))
    draws = _draws(len(first), replicates, seed)
    point = float(
        _al(a, torch.arange(len(first))[None])[0] / _al(b, torch.arange(len(first))[None])[0]
    )
    ci = _interval(_al(a, draws) / _al(b, draws))
    return {"ratio": point, "ci95": ci, "prompts_for_3pct": prompts_for(point, ci, len(first))}


def prompts_for(
    point: float, ci: list[float] | None, n: int, half_width: float = 0.03
) -> int | None:
    """Prompts that would bring the interval's half-width to `half_width` x `point` (its width
    scales as 1/sqrt(n)); None when unknown, n when it is already that narrow."""
    if ci is None or not math.isfinite(point) or point == 0:
        return None
    have = (ci[1] - ci[0]) / 2 / abs(point)
    if have <= half_width:
        return n
    return math.ceil(n * (have / half_width) ** 2)

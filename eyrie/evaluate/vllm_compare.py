"""evaluate-vllm, step 3 (compare): the speculative outputs against the baseline's, token for
token (speculative decoding must not change greedy outputs; a differing prompt fails the stage
with a diagnostic file), and vLLM's acceptance against the Hugging Face evaluation's.
docs/vllm.md (Evaluation through vLLM).
"""

from __future__ import annotations

import logging
from pathlib import Path

from eyrie.core.errors import EvaluateError
from eyrie.core.io import provenance, write_json
from eyrie.evaluate.vllm_check import VllmPlan

log = logging.getLogger(__name__)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix), or None."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def diagnostic_path(out: str | Path) -> Path:
    """Where differing outputs are written: beside the report `out`, as <stem>.mismatch.json."""
    out = Path(out)
    return out.with_name(f"{out.stem}.mismatch.json")


def check_outputs_equal(plan: VllmPlan, base: dict, spec: dict) -> int:
    """Every speculative output must equal the baseline's; otherwise write the diagnostic
    (diagnostic_path) and fail. A stale diagnostic of an earlier failed run is removed. In a
    rehearsal differences are counted (returned) and warned of, not a failure: random weights
    make near-ties of most greedy choices, where batched verification may pick another token."""
    diagnostic = diagnostic_path(plan.paths.out)
    differ = []
    for (sample_id, _), b, s in zip(plan.prompts, base["outputs"], spec["outputs"]):
        at = first_difference(s, b)
        if at is not None:
            differ.append(
                {"sample_id": sample_id, "first_difference": at, "baseline": b, "speculative": s}
            )
    if not differ:
        diagnostic.unlink(missing_ok=True)
        return 0
    write_json(
        diagnostic,
        {
            "num_prompts": len(plan.prompts),
            "outputs_differ": len(differ),
            "prompts": differ,
            "counters": spec["counters"],
            "enforce_eager": plan.cfg.vllm.enforce_eager,
            "provenance": provenance(plan.settings),
        },
    )
    first = differ[0]
    what = (
        f"{plan.paths.eval_set}: {len(differ)} of {len(plan.prompts)} speculative outputs differ "
        f"from vLLM's greedy outputs without speculation (first: prompt {first['sample_id']} at "
        f"new token {first['first_difference']})"
    )
    if plan.cfg.rehearsal:
        log.warning("%s; expected of random weights, not a failure of a rehearsal", what)
        return len(differ)
    raise EvaluateError(
        f"{what}; speculative decoding must not change greedy outputs; details in {diagnostic}"
    )


def difference(counters: dict, hf: dict) -> dict:
    """vLLM minus Hugging Face: AL and per-position acceptance (None where either is missing)."""
    al, hf_al = counters["acceptance_length"], hf["acceptance_length"]
    pp, hf_pp = counters["per_position_acceptance"], hf["per_position_acceptance"]
    return {
        "acceptance_length": None if None in (al, hf_al) else al - hf_al,
        "per_position_acceptance": (
            None
            if pp is None or not isinstance(hf_pp, list) or len(hf_pp) != len(pp)
            else [a - b for a, b in zip(pp, hf_pp)]
        ),
    }

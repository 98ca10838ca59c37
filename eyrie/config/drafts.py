"""Rules about the kind of draft a run trains and the layers it reads, between config keys:
the kinds one run trains (`draft_methods`: train.method names one or lists several), how many
tokens a block drafter proposes (`block_positions`, which training, export and both evaluations
count by) and what a config asks of a draft that it cannot do (`draft_problems`, run by
eyrie.config.schema when a config is read). docs/training.md#block-drafters.
"""

from __future__ import annotations

# The kinds eyrie's vLLM evaluation (and so a rehearsal, whose last stage it is) serves as the
# run's draft: those whose evaluation through vLLM passed on a GPU
# (tests/evaluate/test_evaluate_vllm.py, docs/training.md#block-drafters).
VLLM_EVALUATED = {"eagle3": "EAGLE-3", "dflash": "DFlash"}


def draft_methods(method: str | list[str]) -> list[str]:
    """The kinds of draft a run trains, its own first: train.method names one or lists several
    (the first is the run's draft: draft.json, the vLLM evaluation; each other one is trained
    from the same shards beside it, in drafts/<method>/, and compared: compare/)."""
    return [method] if isinstance(method, str) else list(method)


def block_positions(method: str, block_size: int, sample_from_anchor: bool | None) -> int:
    """The tokens one block of a block drafter proposes: every slot when the anchor's slot
    drafts too (sample_from_anchor; None: the method's own, as speculators defaults it: dspark
    yes, dflash no), else all but the anchor's (the anchor is the target's bonus token)."""
    anchor = method == "dspark" if sample_from_anchor is None else sample_from_anchor
    return block_size if anchor else block_size - 1


def draft_problems(
    train: dict, layers: dict | None, evaluation: dict | None, vllm: dict | None
) -> list[str]:
    """The sections' draft rules: train.aux_ids among the layers extracted; and for a block
    drafter (train.method dflash or dspark) what it cannot do yet or at all: the vLLM
    evaluation (and so a rehearsal, whose last stage it is) serves the run's draft (the first
    listed) only if it is of VLLM_EVALUATED, vLLM never serves a DFlash draft that samples from its
    anchor, and K past a block's tokens. A section that is None (a stage's --settings lacks it)
    leaves out the rules that read it."""
    problems = []
    stored, read = (layers or {}).get("aux_ids"), train.get("aux_ids")
    if isinstance(stored, list) and isinstance(read, list) and not set(read) <= set(stored):
        problems.append(
            f"train.aux_ids: {read} names layers {sorted(set(read) - set(stored))} that "
            f"layers.aux_ids {stored} does not extract; name layers it holds, or add them there"
        )
    methods = draft_methods(train.get("method") or "eagle3")
    if not all(isinstance(m, str) for m in methods):
        return problems  # the schema names the key
    if methods[0] not in VLLM_EVALUATED:  # the run's draft, which the vLLM evaluation serves
        for key, asked in (
            ("eval.vllm", (evaluation or {}).get("vllm")),
            ("vllm.rehearsal", (vllm or {}).get("rehearsal")),
        ):
            if asked is True:
                problems.append(
                    f"{key}: true with train.method: {methods[0]}: eyrie's vLLM evaluation "
                    f"serves {' and '.join(VLLM_EVALUATED.values())} drafts so far ({methods[0]} "
                    f"through vLLM is not yet checked on a GPU); set {key}: false (the Hugging "
                    "Face evaluation decodes block drafters: eval/eval.json) or list "
                    f"{' or '.join(VLLM_EVALUATED)} first in train.method (the others after it "
                    "train beside it)"
                )
    if "dflash" in methods and train.get("sample_from_anchor") is True:
        problems.append(
            "train.sample_from_anchor: true with train.method: dflash: vLLM serves a DFlash "
            "draft's anchor as the bonus token (0.22, 0.26) or refuses the flag (0.33+); set it "
            "to null or false, or use train.method: dspark"
        )
    if evaluation is None:
        return problems
    block, k = train.get("block_size", 8), evaluation.get("num_speculative_tokens", 3)
    for method in methods:
        if method == "eagle3" or not isinstance(block, int) or not isinstance(k, int):
            continue
        most = block_positions(method, block, train.get("sample_from_anchor"))
        if k > most:
            problems.append(
                f"eval.num_speculative_tokens: {k} but a {method} draft with train.block_size "
                f"{block} proposes {most} tokens per forward; set it to at most {most} or raise "
                "train.block_size"
            )
    return problems

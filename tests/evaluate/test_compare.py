"""eyrie compare (eyrie.evaluate.compare): the cost of a draft step read from an exported
draft's weights, and a comparison that refuses evaluations of other prompts. The whole stage runs
in tests/workflow/test_workflow.py (train.method listing three kinds)."""

import json

import pytest

from eyrie.core.errors import EvaluateError
from eyrie.evaluate.compare import compare, step_cost
from tests.support.train_helpers import block_draft


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_block_drafts_step_cost_counts_every_saved_weight_once(world, tmp_path, method):
    """The parameters counted from the safetensors headers are the draft model's own, less those
    speculators does not save (the embedding and the verifier's head and norm, which training
    reads for the target's distribution and a client loads from the verifier), the vocabulary
    maps not among them; one forward a step, over the block's slots."""
    draft = block_draft(world, method)
    draft.save_pretrained(tmp_path)
    cost = step_cost(tmp_path, K=3)
    unsaved = set(draft._keys_to_ignore_on_save)
    own = sum(p.numel() for n, p in draft.named_parameters() if n not in unsaved)
    assert cost["parameters"] == own
    assert cost["method"] == method and cost["forwards_per_step"] == 1
    assert cost["tokens_through_layers"] == (3 if method == "dspark" else 4)
    parts = cost["parameters_by_part"]
    assert parts["fc"] > 0 and parts["layers"] > 0 and parts["per_position"] > 0
    assert (parts["lookup"] > 0) == (method == "dspark")  # DSpark's Markov rows of the last token
    flops = 2 * (cost["tokens_through_layers"] * parts["layers"] + 3 * parts["per_position"])
    assert cost["flops_per_step"] == flops + 2 * parts["fc"]


def test_evaluations_of_other_prompts_are_not_compared(tmp_path):
    evals = []
    for n, ids in enumerate((["a", "b"], ["a", "c"])):
        path = tmp_path / f"eval{n}.json"
        path.write_text(json.dumps({"K": 3, "sample_ids": ids, "num_prompts": 2}))
        evals.append(str(path))
    out = {k: tmp_path / f"compare.{k}" for k in ("json", "md", "plot")}
    with pytest.raises(EvaluateError, match="eval1.json: not decoded on the prompts and K of"):
        compare(["eagle3", "dspark"], evals, [str(tmp_path)] * 2, out)
    assert not any(p.exists() for p in out.values())

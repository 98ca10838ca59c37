"""evaluate-vllm, step 4 (report): eval_vllm.json, vLLM's acceptance beside the Hugging Face
evaluation's, with the engine, the draft and the provenance. docs/vllm.md (Evaluation through
vLLM).
"""

from __future__ import annotations

from eyrie.core.io import provenance
from eyrie.core.rehearsal import mark
from eyrie.evaluate.vllm_check import VllmPlan
from eyrie.evaluate.vllm_compare import difference


def build_report(plan: VllmPlan, spec: dict, differ: int = 0) -> dict:
    """eval_vllm.json (docs/vllm.md, Evaluation through vLLM); `differ` outputs differed from the
    baseline's (a rehearsal's only). Without an HF evaluation `hf` and `difference` are null."""
    cfg, hf, m, n = plan.cfg, plan.hf, spec["counters"], len(plan.prompts)
    counter_keys = ("num_drafts", "num_draft_tokens", "accepted_tokens", "accepted_at_position")
    config_keys = (
        "eagle_aux_hidden_state_layer_ids",
        "draft_vocab_size",
        "norm_before_residual",
        "norm_before_fc",
    )
    return {
        "vllm_version": spec["vllm_version"],
        "K": cfg.K,
        "num_prompts": n,
        "max_new_tokens": cfg.max_new_tokens,
        "outputs_equal": n - differ,
        "output_tokens": sum(len(o) for o in spec["outputs"]),
        "acceptance_length": m["acceptance_length"],
        "per_position_acceptance": m["per_position_acceptance"],
        "counters": {k: m[k] for k in counter_keys},
        "hf": None
        if hf is None
        else {k: hf[k] for k in ("acceptance_length", "per_position_acceptance", "path", "engine")},
        "difference": None if hf is None else difference(m, hf),
        "sampled": sampled(spec.get("sampled"), plan.hf_sampled, counter_keys),
        "eos_token_id": plan.eos_token_id,
        "engine": {
            "name": "vllm",
            "dtype": spec["dtype"],
            "enforce_eager": cfg.vllm.enforce_eager,
            "tensor_parallel_size": cfg.vllm.tensor_parallel_size,
            "gpu_memory_utilization": cfg.vllm.gpu_memory_utilization,
            "max_model_len": plan.max_model_len,
        },
        "draft": str(plan.paths.draft),
        "draft_config": {k: plan.draft_config.get(k) for k in config_keys},
        "target": str(plan.paths.target),
        "provenance": provenance(plan.settings),
        **mark(cfg.rehearsal),  # random weights: its acceptance and outputs mean nothing
    }


def sampled(run: dict | None, hf: dict | None, counter_keys: tuple[str, ...]) -> dict | None:
    """The sampled run's figures (eval.temperature > 0; null otherwise), with the Hugging Face
    evaluation's sampled AL beside them when it sampled at the same temperature."""
    if run is None:
        return None
    m = run["counters"]
    same = hf is not None and hf.get("temperature") == run["temperature"]
    return {
        "temperature": run["temperature"],
        "seed": run["seed"],
        "acceptance_length": m["acceptance_length"],
        "per_position_acceptance": m["per_position_acceptance"],
        "counters": {k: m[k] for k in counter_keys},
        "hf_acceptance_length": hf["trained"]["acceptance_length"] if same else None,
    }

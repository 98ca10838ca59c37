# eyrie: EAGLE-3 draft training, from chat conversations to a draft that `vllm serve` loads.
# This file only includes the rule files and declares the final targets (docs/contracts.md).


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/data.smk"
include: "rules/preflight.smk"
include: "rules/extract.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"


rule all:
    default_target: True
    input:
        f"{RESULTS}/draft.json",
        # the Hugging Face evaluation reads the real weights: not part of a rehearsal
        [] if REHEARSAL else [f"{RESULTS}/eval/eval.json", f"{RESULTS}/eval/eval.png"],
        # evaluation through vLLM itself: needs a GPU and .venv-vllm (docs/vllm.md)
        [f"{RESULTS}/eval/eval_vllm.json"] if VLLM_EVAL else [],
        # vLLM's PTX-only kernels of the target, compiled beside the CPU jobs (rules/extract.smk)
        [f"{RESULTS}/kernels.json"] if VLLM_EXTRACT or VLLM_EVAL else [],
        # the other kinds train.method lists, compared with the run's draft (docs/training.md);
        # a rehearsal rehearses the run's draft alone
        [] if REHEARSAL or not ALSO else f"{RESULTS}/compare/compare.json",


# A failed run ends with one line per failed job: its rule, eyrie's error line and the log.
onerror:
    from eyrie.core.failures import report_failures

    report_failures(workflow)

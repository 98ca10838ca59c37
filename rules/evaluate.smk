# Acceptance length by real greedy speculative decoding on the held-out prompts, or on the first
# turns of an MT-Bench question.jsonl (eval.prompts).

EVAL_PROMPTS = config["eval"]["prompts"]
EVAL_SET = (
    "results/{name}/eval/prompts.parquet"
    if EVAL_PROMPTS
    else "results/{name}/tokenized/eval.parquet"
)


# With eval.prompts: an MT-Bench question.jsonl as the eval set (first turns, the chat template);
# the file is an input, so editing it reruns this and both evaluations.
rule tokenize_eval_prompts:
    input:
        questions=EVAL_PROMPTS or [],
        tokenizer=TARGET_TOKENIZER,
    output:
        "results/{name}/eval/prompts.parquet",
    log:
        "logs/{name}/tokenize_eval_prompts.log",
    params:
        settings=settings("tokenize_eval_prompts"),
        target=target_dir,
    shell:
        "eyrie eval-prompts --target {params.target} --questions {input.questions:q}"
        " --out {output} --settings {params.settings:q} > {log} 2>&1"


rule evaluate_draft:
    input:
        draft="results/{name}/draft.json",
        vocab="results/{name}/vocab/vocab.safetensors",
        eval_set=EVAL_SET,
        preflight="results/{name}/preflight.json",
        target=TARGET_FILES,
    output:
        json="results/{name}/eval/eval.json",
        plot=report(
            "results/{name}/eval/eval.png",
            caption="../docs/report/eval.rst",
            category="Evaluation",
        ),
    log:
        "logs/{name}/evaluate_draft.log",
    benchmark:
        "results/{name}/benchmarks/evaluate_draft.tsv"
    threads: CORES
    resources:
        gpu=gpus(config["eval"]["device"]),
    params:
        settings=settings("evaluate_draft"),
        target=target_dir,
        draft_dir=draft_dir,
    shell:
        "eyrie --threads {threads} evaluate --target {params.target} --draft {params.draft_dir} --vocab {input.vocab}"
        " --eval-set {input.eval_set} --preflight {input.preflight} --out {output.json}"
        " --plot {output.plot} --settings {params.settings:q} > {log} 2>&1"


use rule evaluate_draft as evaluate_also with:
    input:
        draft="results/{name}/methods/{method}/draft.json",
        vocab="results/{name}/vocab/vocab.safetensors",
        eval_set=EVAL_SET,
        preflight="results/{name}/preflight.json",
        target=TARGET_FILES,
    output:
        json="results/{name}/methods/{method}/eval/eval.json",
        plot=report(
            "results/{name}/methods/{method}/eval/eval.png",
            caption="../docs/report/eval.rst",
            category="Evaluation",
            subcategory="{method}",
        ),
    log:
        "logs/{name}/methods/{method}/evaluate_draft.log",
    benchmark:
        "results/{name}/benchmarks/evaluate_draft.{method}.tsv"
    params:
        settings=also_settings("evaluate_draft"),
        target=target_dir,
        draft_dir=also_dir("draft"),


# The kinds of train.method side by side: the run's draft first, each decoded on the same
# prompts (docs/training.md#several-kinds-from-one-extraction).
rule compare_drafts:
    input:
        evals=lambda wc: [f"results/{wc.name}/eval/eval.json"]
        + [f"results/{wc.name}/methods/{m}/eval/eval.json" for m in ALSO],
        drafts=lambda wc: [f"results/{wc.name}/draft.json"]
        + [f"results/{wc.name}/methods/{m}/draft.json" for m in ALSO],
    output:
        json="results/{name}/compare/compare.json",
        table="results/{name}/compare/compare.md",
        plot=report(
            "results/{name}/compare/compare.png",
            caption="../docs/report/compare.rst",
            category="Evaluation",
        ),
    log:
        "logs/{name}/compare_drafts.log",
    params:
        methods=METHODS,
        draft_dirs=lambda wc: [draft_dir(wc)]
        + [f"results/{wc.name}/methods/{m}/draft" for m in ALSO],
    shell:
        "eyrie compare --methods {params.methods} --evals {input.evals}"
        " --drafts {params.draft_dirs} --out {output.json} --table {output.table}"
        " --plot {output.plot} > {log} 2>&1"


# A rehearsal serves its draft without the Hugging Face evaluation (which reads the real weights);
# a real run's command text stays what it was (Snakemake's code trigger compares it).
# --runtime holds what it reads but does not compare (the settings table's read column).
EVALUATE_VLLM_RUNTIME = settings_json(runtime_settings(config, "evaluate_vllm"))
EVALUATE_VLLM_SHELL = (
    "{params.python} -m eyrie.cli evaluate-vllm --target {params.target} --draft {params.draft_dir}"
    " --eval-set {input.eval_set}"
    + ("" if REHEARSAL else " --hf-eval {input.hf_eval}")
    + " --out {output.json} --runtime {EVALUATE_VLLM_RUNTIME:q}"
    " --settings {params.settings:q} > {log} 2>&1"
)


# The same draft served by vLLM itself (eval.vllm: true; needs a GPU and the vLLM environment):
# acceptance from vLLM's own counters, beside the Hugging Face evaluation's (docs/vllm.md).
# gpu_memory_utilization changes no result: --runtime (command text), not compared.
rule evaluate_vllm:
    input:
        draft="results/{name}/draft.json",
        eval_set=EVAL_SET,
        hf_eval=[] if REHEARSAL else "results/{name}/eval/eval.json",
        target=TARGET_FILES,
    output:
        json="results/{name}/eval/eval_vllm.json",
    log:
        "logs/{name}/evaluate_vllm.log",
    benchmark:
        "results/{name}/benchmarks/evaluate_vllm.tsv"
    resources:
        gpu=VLLM_GPUS,
    params:
        settings=settings("evaluate_vllm"),
        # compared: another environment may be another vLLM
        python=VLLM_PYTHON_ARG,
        target=target_dir,
        draft_dir=draft_dir,
    shell:
        EVALUATE_VLLM_SHELL

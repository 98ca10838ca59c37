# Acceptance length by real greedy speculative decoding on the held-out prompts.

# eval.vllm only asks for the vLLM evaluation below: it changes neither rule's output.
EVAL_SETTINGS = {k: v for k, v in config["eval"].items() if k != "vllm"}


rule evaluate_draft:
    input:
        draft="results/{name}/draft/config.json",
        vocab="results/{name}/vocab/vocab.safetensors",
        eval_set="results/{name}/tokenized/eval.parquet",
        preflight="results/{name}/preflight.json",
        target=TARGET_FILES,
    output:
        json="results/{name}/eval/eval.json",
        plot=report("results/{name}/eval/eval.png", caption="../docs/report/eval.rst", category="Evaluation"),
    params:
        settings=settings(eval=EVAL_SETTINGS),
        target=TARGET,
        draft_dir="results/{name}/draft",
    log:
        "logs/{name}/evaluate_draft.log",
    benchmark:
        "results/{name}/benchmarks/evaluate_draft.tsv"
    threads: CORES
    resources:
        gpu=gpus(config["eval"]["device"]),
    shell:
        "eyrie --threads {threads} evaluate --target {params.target} --draft {params.draft_dir} --vocab {input.vocab}"
        " --eval-set {input.eval_set} --preflight {input.preflight} --out {output.json}"
        " --plot {output.plot} --settings {params.settings:q} > {log} 2>&1"


# The same draft served by vLLM itself (eval.vllm: true; needs a GPU and the vLLM environment):
# acceptance from vLLM's own counters, beside the Hugging Face evaluation's (docs/vllm.md).
# params.settings: the eval settings (eval.device is the HF loop's) and the vllm keys that change
# the result. The vLLM python is a param too (another environment may be another vLLM);
# gpu_memory_utilization changes no result, so it comes from config in the command text (not
# compared: no rerun).
VLLM_EVAL_SETTINGS = settings(
    eval={k: v for k, v in EVAL_SETTINGS.items() if k != "device"},
    vllm={k: config["vllm"][k] for k in ("tensor_parallel_size", "enforce_eager", "max_model_len", "dtype")},
)


rule evaluate_vllm:
    input:
        draft="results/{name}/draft/config.json",
        eval_set="results/{name}/tokenized/eval.parquet",
        hf_eval="results/{name}/eval/eval.json",
        target=TARGET_FILES,
    output:
        json="results/{name}/eval/eval_vllm.json",
    params:
        settings=VLLM_EVAL_SETTINGS,
        python=os.path.join(workflow.basedir, config["vllm"]["python"]),
        target=TARGET,
        draft_dir="results/{name}/draft",
    log:
        "logs/{name}/evaluate_vllm.log",
    benchmark:
        "results/{name}/benchmarks/evaluate_vllm.tsv"
    resources:
        gpu=VLLM_GPUS,
    shell:
        "{params.python} -m eyrie.cli evaluate-vllm --target {params.target} --draft {params.draft_dir}"
        " --eval-set {input.eval_set} --hf-eval {input.hf_eval} --out {output.json}"
        " --gpu-memory-utilization {config[vllm][gpu_memory_utilization]}"
        " --settings {params.settings:q} > {log} 2>&1"

# Acceptance length by real greedy speculative decoding on the held-out prompts.


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
        settings=settings(eval=config["eval"]),
        target=TARGET,
        draft_dir="results/{name}/draft",
    log:
        "logs/{name}/evaluate_draft.log",
    benchmark:
        "results/{name}/benchmarks/evaluate_draft.tsv"
    threads: workflow.cores
    shell:
        "eyrie --threads {threads} evaluate --target {params.target} --draft {params.draft_dir} --vocab {input.vocab}"
        " --eval-set {input.eval_set} --preflight {input.preflight} --out {output.json}"
        " --plot {output.plot} --settings {params.settings:q} > {log} 2>&1"

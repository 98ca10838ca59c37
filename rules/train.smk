# Draft training (resumable state kept outside the outputs) and the vLLM export; each kind listed
# after the first in train.method the same, in methods/<method>/.


rule train_draft:
    input:
        shards=expand("results/{{name}}/hidden/shard_{shard}.h5", shard=TRAIN_SHARDS),
        vocab="results/{name}/vocab/vocab.safetensors",
        preflight="results/{name}/preflight.json",
        target=TARGET_WEIGHTS,
    output:
        draft=directory("results/{name}/train/draft"),
        metrics="results/{name}/train/metrics.jsonl",
        curves=report(
            "results/{name}/train/curves.png",
            caption="../docs/report/curves.rst",
            category="Training",
        ),
        summary="results/{name}/train/train.json",
    log:
        "logs/{name}/train_draft.log",
    benchmark:
        "results/{name}/benchmarks/train_draft.tsv"
    threads: CORES
    # One training process per GPU (torchrun, started by `eyrie train` itself), the job's GPUs
    # split evenly over its nodes; the slurm-gpu profile sets both (EYRIE_TRAIN_GPUS/_NODES).
    # The number of processes does not change the weights (docs/training.md): not a param.
    resources:
        gpu=gpus(config["train"]["device"]),
        nodes=1,
    params:
        settings=settings("train_draft"),
        target=target_dir,
        out_dir=train_dir,
        state_dir="results/{name}/train_state",
    shell:
        "eyrie --threads {threads} train --nproc-per-node $(( {resources.gpu} > 0 ? {resources.gpu} / {resources.nodes} : 1 ))"
        " --nnodes {resources.nodes} --target {params.target} --preflight {input.preflight} --vocab {input.vocab}"
        " --shards {input.shards} --out-dir {params.out_dir} --state-dir {params.state_dir}"
        " --settings {params.settings:q} > {log} 2>&1"


rule export_draft:
    input:
        summary="results/{name}/train/train.json",
        target=TARGET_WEIGHTS,
    # The manifest, not the draft's files: Snakemake deletes outputs before a job runs, and the
    # draft `vllm serve` uses must outlive a failed export (eyrie.formats.versions).
    output:
        "results/{name}/draft.json",
    log:
        "logs/{name}/export_draft.log",
    # torch's CPU threads: the draft is loaded and compared on the CPU (a rehearsal's random
    # verifier rows are drawn on all of them)
    threads: CORES
    params:
        settings=settings("export_draft"),
        target=target_dir,
        train_dir=train_dir,
        out_dir=draft_dir,
    shell:
        "eyrie --threads {threads} export --target {params.target} --train-dir {params.train_dir}"
        " --out-dir {params.out_dir} --manifest {output} --settings {params.settings:q} > {log} 2>&1"


use rule train_draft as train_also with:
    output:
        draft=directory("results/{name}/methods/{method}/train/draft"),
        metrics="results/{name}/methods/{method}/train/metrics.jsonl",
        curves=report(
            "results/{name}/methods/{method}/train/curves.png",
            caption="../docs/report/curves.rst",
            category="Training",
            subcategory="{method}",
        ),
        summary="results/{name}/methods/{method}/train/train.json",
    log:
        "logs/{name}/methods/{method}/train_draft.log",
    benchmark:
        "results/{name}/benchmarks/train_draft.{method}.tsv"
    params:
        settings=also_settings("train_draft"),
        target=target_dir,
        out_dir=also_dir("train"),
        state_dir=also_dir("train_state"),


use rule export_draft as export_also with:
    input:
        summary="results/{name}/methods/{method}/train/train.json",
        target=TARGET_WEIGHTS,
    output:
        "results/{name}/methods/{method}/draft.json",
    log:
        "logs/{name}/methods/{method}/export_draft.log",
    params:
        settings=also_settings("export_draft"),
        target=target_dir,
        train_dir=also_dir("train"),
        out_dir=also_dir("draft"),

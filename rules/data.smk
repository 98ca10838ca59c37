# Conversations -> tokenized shards (+ held-out eval set) -> draft vocabulary map.
#
# The N shard files are not listed as outputs: report.json, written last into the same folder
# (the stage replaces the whole folder at once, eyrie.io.atomic_path), is their manifest, and
# the rules that read shards take it as input and derive the shard paths. A rule with N explicit
# outputs makes Snakemake's planning quadratic in N (BENCHMARKS.md "Workflow overhead"). So a shard
# file deleted by hand goes unnoticed until a job reads it (and fails naming it): delete
# report.json to tokenize again.


rule tokenize_conversations:
    input:
        conversations=CONVERSATIONS,
        target=TARGET_FILES,
    output:
        eval="results/{name}/tokenized/eval.parquet",
        report="results/{name}/tokenized/report.json",
    log:
        "logs/{name}/tokenize_conversations.log",
    params:
        settings=settings("tokenize_conversations"),
        target=target_dir,
        out_dir=tokenized_dir,
    shell:
        "eyrie --threads {threads} tokenize --target {params.target} --inputs {input.conversations:q}"
        " --out-dir {params.out_dir} --settings {params.settings:q} > {log} 2>&1"


rule build_vocab_map:
    input:
        tokenized="results/{name}/tokenized/report.json",
        target=TARGET_FILES,
    output:
        "results/{name}/vocab/vocab.safetensors",
    log:
        "logs/{name}/build_vocab_map.log",
    params:
        settings=settings("build_vocab_map"),
        target=target_dir,
        # the shards report.json lists, in order (the tokenize stage writes them all at once)
        shards=expand("results/{{name}}/tokenized/shard_{shard}.parquet", shard=SHARDS),
    shell:
        "eyrie --threads {threads} vocab --target {params.target} --shards {params.shards} --out {output}"
        " --settings {params.settings:q} > {log} 2>&1"

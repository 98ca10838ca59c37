# Conversations -> tokenized shards (+ held-out eval set) -> draft vocabulary map.
# The shard files are not outputs: report.json, written last, is their manifest (N explicit
# outputs make planning quadratic in N); delete report.json to tokenize again (docs/contracts.md).


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

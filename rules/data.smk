# Conversations -> tokenized shards (+ held-out eval set) -> draft vocabulary map.


rule tokenize_conversations:
    input:
        conversations=CONVERSATIONS,
        target=TARGET_FILES,
    output:
        shards=expand("results/{{name}}/tokenized/shard_{shard}.parquet", shard=SHARDS),
        eval="results/{name}/tokenized/eval.parquet",
        report="results/{name}/tokenized/report.json",
    params:
        settings=settings(data=config["data"], trust_remote_code=TRUST),
        target=TARGET,
        out_dir="results/{name}/tokenized",
    log:
        "logs/{name}/tokenize_conversations.log",
    shell:
        "eyrie --threads {threads} tokenize --target {params.target} --inputs {input.conversations:q}"
        " --out-dir {params.out_dir} --settings {params.settings:q} > {log} 2>&1"


rule build_vocab_map:
    input:
        shards=expand("results/{{name}}/tokenized/shard_{shard}.parquet", shard=SHARDS),
        target=TARGET_FILES,
    output:
        "results/{name}/vocab/vocab.safetensors",
    params:
        settings=settings(vocab=config["vocab"]),
        target=TARGET,
    log:
        "logs/{name}/build_vocab_map.log",
    shell:
        "eyrie --threads {threads} vocab --target {params.target} --shards {input.shards} --out {output}"
        " --settings {params.settings:q} > {log} 2>&1"

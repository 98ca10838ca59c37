# The embedded demo: conversations from Python docstrings and a small Llama trained on them.
# Only used when target.path is null.


rule build_demo_conversations:
    output:
        "resources/{name}/conversations.jsonl",
    log:
        "logs/{name}/build_demo_conversations.log",
    params:
        settings=settings("build_demo_conversations"),
    shell:
        "eyrie --threads {threads} demo-conversations --out {output} --settings {params.settings:q} > {log} 2>&1"


rule build_demo_target:
    input:
        "resources/{name}/conversations.jsonl",
    output:
        "results/{name}/target/config.json",
        "results/{name}/target/tokenizer_config.json",
        "results/{name}/target/model.safetensors",
    log:
        "logs/{name}/build_demo_target.log",
    benchmark:
        "results/{name}/benchmarks/build_demo_target.tsv"
    threads: CORES
    resources:
        gpu=gpus(config["demo"]["device"]),
    params:
        settings=settings("build_demo_target"),
        out_dir=demo_target_dir,
    shell:
        "eyrie --threads {threads} demo-target --conversations {input} --out-dir {params.out_dir}"
        " --settings {params.settings:q} > {log} 2>&1"

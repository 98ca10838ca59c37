# Target hidden states: one HDF5 file (and one job) per tokenized shard, the target loaded once
# per group of `extract.group_size` shards by an engine job that serves the group's shard jobs
# over a unix socket (a Snakemake service). Only missing or stale shards rebuild, and their
# group's engine with them. Why each piece is there: docs/extraction.md.

# The engine's --settings are its shard jobs' params.settings (a client must match its engine).
EXTRACT_SETTINGS = settings("extract_hidden_states")
# The engine runs in the environment of its backend: vLLM pins its own torch (envs/vllm.txt).
ENGINE_COMMAND = (
    f"{VLLM_PYTHON} -m eyrie.cli extract-engine"
    f" --gpu-memory-utilization {config['vllm']['gpu_memory_utilization']}"
    if VLLM_EXTRACT
    else "eyrie extract-engine"
)


# The engine job must never be planned for reasons of its own: Snakemake records metadata for
# service outputs too, and an engine found stale (by params, input or mtime) is planned WITHOUT
# its shards (it masks them, and the ancient socket keeps them from being re-queued), loads the
# target for nothing and idles out. So its inputs are ancient() and it has no params (settings
# and target come from globals in the command text); the shard jobs carry the triggers.
rule extract_engine:
    input:
        preflight=ancient("results/{name}/preflight.json"),
        target=[ancient(f) for f in TARGET_FILES],
    output:
        service("results/{name}/hidden/engine_{group}.sock"),
    log:
        "logs/{name}/extract_engine/engine_{group}.log",
    benchmark:
        "results/{name}/benchmarks/extract_engine/engine_{group}.tsv"
    wildcard_constraints:
        group=r"\d+",
    threads: CORES
    # The group's only GPU job: its shard jobs run inside the same SLURM job, asking for none.
    resources:
        gpu=VLLM_GPUS if VLLM_EXTRACT else gpus(config["extract"]["device"]),
    # `exec`: Snakemake's SIGTERM after the last shard then reaches the engine, not just bash.
    # --torch-threads, not the global --threads: the socket must exist before torch is imported.
    shell:
        "exec {ENGINE_COMMAND} --torch-threads {threads} --socket {output} --target {TARGET}"
        " --preflight {input.preflight} --settings {EXTRACT_SETTINGS:q} > {log} 2>&1"


rule extract_hidden_states:
    # Few inputs: each costs every one of the N jobs a producer lookup in planning. The target
    # files are not listed: preflight.json depends on them, so a changed target reruns the shards
    # through it (and params.target names the folder).
    input:
        # the manifest of the tokenized shards (rules/data.smk): one edge per shard job, not N
        tokenized="results/{name}/tokenized/report.json",
        preflight="results/{name}/preflight.json",
        engine=engine_socket,
    output:
        "results/{name}/hidden/shard_{shard}.h5",
    log:
        "logs/{name}/extract_hidden_states/shard_{shard}.log",
    benchmark:
        "results/{name}/benchmarks/extract_hidden_states/shard_{shard}.tsv"
    wildcard_constraints:
        shard=r"\d+",
    # A client: it waits on the engine. Its resources add to the engine's (one group job).
    threads: 0
    resources:
        mem_mb=100,
    params:
        settings=EXTRACT_SETTINGS,
        target=target_dir,
        shard="results/{name}/tokenized/shard_{shard}.parquet",
        engine_log=engine_log,
    # engine_wait_s: command text, not compared (changing it reruns nothing)
    shell:
        "eyrie extract --engine {input.engine} --engine-log {params.engine_log}"
        " --engine-wait-s {config[extract][engine_wait_s]} --target {params.target} --shard {params.shard}"
        " --preflight {input.preflight} --out {output} --settings {params.settings:q} > {log} 2>&1"

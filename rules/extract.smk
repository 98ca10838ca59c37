# Target hidden states: one HDF5 file (and one job) per tokenized shard, the target loaded once
# per group of `extract.group_size` shards by an engine job that serves the group's shard jobs
# over a unix socket (a Snakemake service). Only missing or stale shards rebuild, and their
# group's engine with them. Why each piece is there: docs/extraction.md.

# The engine's --settings are its shard jobs' params.settings (a client must match its engine).
EXTRACT_SETTINGS = settings("extract_hidden_states")
# --runtime holds what the engine reads but does not compare (the settings table's read column):
# the vLLM engine's GPU memory share. Changing it reruns nothing.
ENGINE_RUNTIME = settings_json(vllm_stage_runtime(config, "extract_engine"))
# The engine runs in the environment of its backend: vLLM pins its own torch (envs/vllm.txt).
ENGINE_COMMAND = (
    f"{VLLM_PYTHON_ARG} -m eyrie.cli extract-engine --runtime {shlex.quote(ENGINE_RUNTIME)}"
    if VLLM_EXTRACT
    else "eyrie extract-engine"
)


# The target's vLLM kernels this GPU can only compile from PTX (vLLM 0.22-0.26 ship the Marlin MoE
# kernels of int4 experts without sm_90 code), compiled into cache.path's driver cache while
# tokenization and preflight run; engines take the cache's lock, then load them instead of
# compiling them on one thread inside their start (docs/rehearsal.md). Beside it, the vLLM facts
# preflight reads, under their own lock. Only `all` asks for it: no job waits on it but through
# those locks, and a rerun of it reruns nothing.
rule compile_kernels:
    input:
        f"{TARGET}/config.json",
    output:
        "results/{name}/kernels.json",
    log:
        "logs/{name}/compile_kernels.log",
    # 0: locally it takes none of the cores the extraction engine claims (all of them), so the
    # engine starts as soon as preflight passed and waits on the lock, not on this job; the
    # compilation is one thread (the slurm-gpu profile gives the job 2 CPUs)
    threads: 0
    resources:
        gpu=1,
    params:
        # compared: another environment may be another vLLM, with other kernels
        python=VLLM_PYTHON_ARG,
        target=target_dir,
    shell:
        "{params.python} -m eyrie.cli compile-kernels --target {params.target} --out {output}"
        " --python {params.python}"
        " > {log} 2>&1"


# No params and ancient() inputs: an engine found stale by its own triggers would be planned
# without its shards (docs/extraction.md); the shard jobs carry the triggers.
rule extract_engine:
    input:
        preflight=ancient("results/{name}/preflight.json"),
        target=[ancient(f) for f in TARGET_FILES],
    output:
        service("results/{name}/hidden/engine_{group}.sock"),
    # No benchmark: file: Snakemake writes it only once a service has exited after its SIGTERM,
    # and a file still missing after the latency wait (a vLLM engine core takes longer than the
    # default 5 s to stop) fails the group job, whose good shards Snakemake then deletes. The
    # engine's log has its load and per-shard times.
    log:
        "logs/{name}/extract_engine/engine_{group}.log",
    wildcard_constraints:
        group=r"\d+",
    threads: CORES
    # The group's only GPU job: its shard jobs run inside the same SLURM job, asking for none.
    resources:
        gpu=VLLM_GPUS if VLLM_EXTRACT else gpus(config["extract"]["device"]),
    # `exec`: Snakemake's SIGTERM after the last shard then reaches the engine, not just bash.
    # --torch-threads, not the global --threads: the socket must exist before torch is imported.
    shell:
        "exec {ENGINE_COMMAND} --torch-threads {threads} --socket {output} --target {TARGET_ARG}"
        " --preflight {input.preflight} --settings {EXTRACT_SETTINGS:q} > {log} 2>&1"


rule extract_hidden_states:
    # Few inputs (each costs all N jobs a lookup in planning): a changed target reruns the shards
    # through preflight.json.
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
    # engine_wait_s: command text, not compared (changing it reruns nothing); a flag, not in
    # --runtime: another command text would rerun every finished shard once (docs/contracts.md)
    shell:
        "eyrie extract --engine {input.engine} --engine-log {params.engine_log}"
        " --engine-wait-s {config[extract][engine_wait_s]} --target {params.target} --shard {params.shard}"
        " --preflight {input.preflight} --out {output} --settings {params.settings:q} > {log} 2>&1"

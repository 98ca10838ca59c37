# Target hidden states, one job (and one HDF5 file) per tokenized shard.


rule extract_hidden_states:
    input:
        shard="results/{name}/tokenized/shard_{shard}.parquet",
        preflight="results/{name}/preflight.json",
        target=TARGET_FILES,
    output:
        "results/{name}/hidden/shard_{shard}.h5",
    params:
        settings=settings(extract=config["extract"], layers=config["layers"], trust_remote_code=TRUST),
        target=TARGET,
    log:
        "logs/{name}/extract_hidden_states/shard_{shard}.log",
    benchmark:
        "results/{name}/benchmarks/extract_hidden_states/shard_{shard}.tsv"
    shell:
        "eyrie --threads {threads} extract --target {params.target} --shard {input.shard} --preflight {input.preflight}"
        " --out {output} --settings {params.settings:q} > {log} 2>&1"

# CPU-only checks in seconds; every GPU-costly rule takes the report as input.


rule preflight:
    input:
        target=TARGET_FILES,
        report="results/{name}/tokenized/report.json",
    output:
        "results/{name}/preflight.json",
    params:
        settings=settings(
            layers=config["layers"],
            extract={"storage_dtype": config["extract"]["storage_dtype"]},
            trust_remote_code=TRUST,
        ),
        target=TARGET,
    log:
        "logs/{name}/preflight.log",
    shell:
        "eyrie --threads {threads} preflight --target {params.target} --tokenize-report {input.report}"
        " --out {output} --settings {params.settings:q} > {log} 2>&1"

# CPU-only checks in seconds; every GPU-costly rule takes the report as input.
# With extract.backend: vllm or eval.vllm: true preflight also checks the installed vLLM
# (eyrie.vllm.preflight_checks, docs/vllm.md). params.settings holds what changes the extraction;
# PREFLIGHT_RUNTIME (the vLLM environment, GPU memory, eval.vllm) is read but not compared, so
# changing it reruns nothing downstream.

from eyrie.vllm.preflight_checks import rule_settings, runtime_settings

PREFLIGHT_RUNTIME = settings(**runtime_settings(config))


rule preflight:
    input:
        target=TARGET_FILES,
        report="results/{name}/tokenized/report.json",
    output:
        "results/{name}/preflight.json",
    params:
        settings=settings(**rule_settings(config)),
        target=TARGET,
    log:
        "logs/{name}/preflight.log",
    shell:
        "eyrie --threads {threads} preflight --target {params.target} --tokenize-report {input.report}"
        " --out {output} --settings {params.settings:q} --runtime {PREFLIGHT_RUNTIME:q} > {log} 2>&1"

# CPU-only checks in seconds; every GPU-costly rule takes the report as input. With vLLM in use
# it also checks the installed vLLM (docs/vllm.md). --runtime holds what it reads but does not
# compare (the vLLM environment, GPU memory, eval.vllm): changing that reruns nothing.

PREFLIGHT_RUNTIME = settings_json(runtime_settings(config, "preflight"))


rule preflight:
    input:
        target=TARGET_FILES,
        report="results/{name}/tokenized/report.json",
    output:
        "results/{name}/preflight.json",
    log:
        "logs/{name}/preflight.log",
    params:
        settings=settings("preflight"),
        target=target_dir,
    shell:
        "eyrie --threads {threads} preflight --target {params.target} --tokenize-report {input.report}"
        " --out {output} --settings {params.settings:q} --runtime {PREFLIGHT_RUNTIME:q} > {log} 2>&1"


# The same target checks before regeneration (no tokenize report exists yet): the regenerate jobs
# load the target, so a broken target fails here in seconds. They take it as ancient() input:
# a rerun of this check (layers.aux_ids changed) reruns no regeneration. With
# regenerate.backend: vllm it also runs the vLLM environment (--runtime; only then in the text).
_REGENERATE_RUNTIME = runtime_settings(config, "preflight_regenerate")
PREFLIGHT_REGENERATE_RUNTIME = (
    f" --runtime {shlex.quote(settings_json(_REGENERATE_RUNTIME))}" if _REGENERATE_RUNTIME else ""
)


rule preflight_regenerate:
    input:
        target=TARGET_FILES,
    output:
        "results/{name}/preflight-regenerate.json",
    log:
        "logs/{name}/preflight_regenerate.log",
    params:
        settings=settings("preflight_regenerate"),
        target=target_dir,
    shell:
        "eyrie --threads {threads} preflight --target {params.target} --out {output}"
        " --settings {params.settings:q}{PREFLIGHT_REGENERATE_RUNTIME} > {log} 2>&1"

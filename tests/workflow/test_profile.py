"""profiles/slurm-gpu, read as Snakemake reads it (yte), without a cluster: a rule made from
another (`use rule X as Y`, each kind listed after the first in train.method) gets the same
threads, partition, GPUs, memory and time as X; without them a training job would go to the CPU
partition with 8 GB and an hour."""

import re

import yte

from tests.support import REPO


def test_rules_made_from_others_get_their_slurm_settings():
    text = "\n".join(p.read_text() for p in sorted((REPO / "rules").glob("*.smk")))
    derived = re.findall(r"^use rule (\w+) as (\w+) with:", text, re.M)
    assert derived
    with open(REPO / "profiles/slurm-gpu/config.yaml") as f:
        profile = yte.process_yaml(f, require_use_yte=True)
    for section in ("set-threads", "set-resources"):
        for base, rule in derived:
            assert profile[section].get(rule) == profile[section].get(base), (section, rule)


def test_rules_that_always_ask_for_a_gpu_go_to_the_gpu_partition():
    """A rule whose `gpu` resource is not only gpus(<a *.device setting>) asks sbatch for GPUs
    (always, or with a vLLM backend): on the CPU partition that job would never start."""
    text = "\n".join(p.read_text() for p in sorted((REPO / "rules").glob("*.smk")))
    always = {
        name
        for name, body in re.findall(r"^rule (\w+):\n((?:(?:    .*)?\n)+)", text, re.M)
        if re.search(r"^        gpu=(?!gpus\()", body, re.M)
    }
    assert {"compile_kernels", "evaluate_vllm", "regenerate_responses"} <= always
    with open(REPO / "profiles/slurm-gpu/config.yaml") as f:
        profile = yte.process_yaml(f, require_use_yte=True)
    for rule in always:
        partition = profile["set-resources"].get(rule, {}).get("slurm_partition")
        assert partition and "EYRIE_GPU_PARTITION" in partition, rule

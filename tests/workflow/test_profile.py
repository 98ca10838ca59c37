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

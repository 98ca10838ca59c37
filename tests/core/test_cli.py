"""The CLI layer: thread counts never exceed the CPUs the process may use."""

import os

from eyrie.core.runtime import usable_threads


def test_threads_are_capped_at_the_usable_cpus():
    cpus = len(os.sched_getaffinity(0))
    assert usable_threads(cpus + 62) == cpus  # e.g. a SLURM grant above the node's real cores
    assert usable_threads(1) == 1

"""The real Snakemake DAG on a tiny config: the session's one full run (tests/conftest.py's
`tiny_run`), then dry runs that prove only stale outputs rebuild (Snakemake's own planner decides;
we only read its job table), and real reruns on copies of the run (copy_run), e.g. after deleting
hidden-state shards (one engine, one model load, only those shards)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.workflow import (
    copy_run,
    job_table,
    planned,
    run_snakemake,
    snakemake,
    write_config,
)

# What a changed training setting reruns, and every change upstream of training after its own jobs.
FROM_TRAINING = {"train_draft": 1, "export_draft": 1, "evaluate_draft": 1, "all": 1}


def planned_with(workdir: Path, **overrides) -> dict[str, int]:
    """What a dry run plans with `overrides` in the config (write_config's); the config is put
    back afterwards."""
    write_config(workdir, **overrides)
    try:
        return planned(workdir)
    finally:
        write_config(workdir)


def engine_log(workdir: Path, group: str = "000") -> str:
    return (workdir / f"logs/tiny/extract_engine/engine_{group}.log").read_text()


def served_shards(log: str) -> list[str]:
    return sorted(re.findall(r"engine: request \S+/(shard_\d+)\.parquet", log))


def test_one_shard_plans_only_what_that_shard_needs(tmp_path):
    """Before anything is built, asking for one shard plans only the jobs that shard needs."""
    write_config(tmp_path)
    (tmp_path / "convs.jsonl").touch()
    assert planned(tmp_path, "results/tiny/hidden/shard_001.h5") == {
        "build_demo_conversations": 1,
        "build_demo_target": 1,
        "tokenize_conversations": 1,
        "preflight": 1,
        "extract_engine": 1,
        "extract_hidden_states": 1,
    }


@pytest.mark.slow
def test_full_run_outputs(tiny_run):
    ev = json.loads((tiny_run / "results/tiny/eval/eval.json").read_text())
    assert ev["outputs_match_target_greedy"] is True
    for which in ("trained", "untrained"):
        assert ev[which]["num_drafts"] > 0
        assert 1.0 <= ev[which]["acceptance_length"] <= 1 + ev["K"]
    draft_cfg = json.loads((tiny_run / "results/tiny/draft/config.json").read_text())
    assert draft_cfg["speculators_model_type"] == "eagle3"
    assert draft_cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert (tiny_run / "results/tiny/eval/eval.png").stat().st_size > 0
    assert (tiny_run / "logs/tiny/train_draft.log").stat().st_size > 0


@pytest.mark.slow
def test_full_run_loads_the_target_once_for_all_shards(tiny_run):
    log = engine_log(tiny_run)
    assert log.count("engine: loaded target") == 1
    assert served_shards(log) == ["shard_000", "shard_001", "shard_002", "shard_003"]
    # Snakemake ends the engine with SIGTERM once its last shard job is done (the rule `exec`s
    # the engine so the signal reaches it); the idle exit is only the fallback.
    assert "engine: SIGTERM received: exiting" in log and "engine: idle for" not in log
    # Snakemake removes service outputs after the group; a placeholder stands in between runs
    sock = tiny_run / "results/tiny/hidden/engine_000.sock"
    assert not sock.is_socket()


@pytest.mark.slow
def test_second_run_plans_nothing(tiny_run):
    assert planned(tiny_run) == {}


@pytest.mark.slow
def test_a_copy_of_the_run_plans_nothing(tiny_run, tmp_path):
    """copy_run's copy is a finished run of its own (what the tests that run jobs work on)."""
    assert planned(copy_run(tiny_run, tmp_path / "wf")) == {}


@pytest.mark.slow
def test_training_setting_reruns_only_train_export_evaluate(tiny_run):
    assert planned_with(tiny_run, train__learning_rate=1e-3) == FROM_TRAINING


@pytest.mark.slow
def test_a_finished_eagle3_run_switched_to_block_drafters_retrains_from_its_shards(
    tiny_run, tmp_path
):
    """train.method on a finished EAGLE-3 run (on a copy): dspark reruns training, export and
    evaluation only (the shards, tokenization and preflight stay), the draft exported as its
    kind and evaluated by decoding; then listing dflash and eagle3 after it trains, exports and
    evaluates those two beside it and compares the three, rerunning none of the run's draft's
    jobs; a rerun plans nothing."""
    work = tmp_path / "wf"
    copy_run(tiny_run, work)
    shards = sorted((work / "results/tiny/hidden").glob("shard_*.h5"))
    before = [p.stat().st_mtime_ns for p in shards]
    write_config(work, train__method="dspark")
    assert planned(work) == FROM_TRAINING
    assert job_table(snakemake(work)) == FROM_TRAINING
    draft = json.loads((work / "results/tiny/draft/config.json").read_text())
    assert draft["speculators_model_type"] == "dspark"
    ev = json.loads((work / "results/tiny/eval/eval.json").read_text())
    assert ev["outputs_match_target_greedy"] is True and ev["trained"]["num_drafts"] > 0
    assert planned(work) == {}

    run_draft = (work / "results/tiny/draft.json").stat().st_mtime_ns
    write_config(work, train__method=["dspark", "dflash", "eagle3"])
    also = {"train_also": 2, "export_also": 2, "evaluate_also": 2, "compare_drafts": 1, "all": 1}
    assert planned(work) == also
    assert job_table(snakemake(work)) == also
    for method in ("dflash", "eagle3"):
        folder = work / "results/tiny/methods" / method
        draft = json.loads((folder / "draft/config.json").read_text())
        assert draft["speculators_model_type"] == method
        ev = json.loads((folder / "eval/eval.json").read_text())
        assert ev["outputs_match_target_greedy"] is True and ev["trained"]["num_drafts"] > 0
    compared = json.loads((work / "results/tiny/compare/compare.json").read_text())
    rows = {row["method"]: row for row in compared["methods"]}
    assert list(rows) == ["dspark", "dflash", "eagle3"] and compared["best"] in rows
    assert rows["dspark"]["over_run_draft"]["ratio"] == 1.0
    assert rows["eagle3"]["cost"]["forwards_per_step"] == compared["K"]
    assert rows["dflash"]["cost"]["forwards_per_step"] == 1
    assert "| dflash |" in (work / "results/tiny/compare/compare.md").read_text()
    assert (work / "results/tiny/draft.json").stat().st_mtime_ns == run_draft
    assert planned(work) == {}
    assert [p.stat().st_mtime_ns for p in shards] == before


def dag_styles(workdir: Path) -> dict[str, set[str]]:
    """Rule -> node styles in `snakemake --dag` (dot): "dashed" marks a job that needs no run."""
    dot = snakemake(workdir, "--dag")
    # a label is the rule's name, then "\n<wildcard>: <value>" for the wildcards its inputs lack
    nodes = re.findall(r'label = "(\w+)(?:\\n[^"]*)?".*?style="([\w,]+)"', dot)
    assert nodes, dot[-2000:]
    styles: dict[str, set[str]] = {}
    for rule, style in nodes:
        styles.setdefault(rule, set()).add("dashed" if "dashed" in style else "solid")
    return styles


@pytest.mark.slow
def test_dag_draws_built_jobs_dashed(tiny_run):
    assert all(s == {"dashed"} for s in dag_styles(tiny_run).values())
    write_config(tiny_run, train__learning_rate=1e-3)
    try:
        styles = dag_styles(tiny_run)
    finally:
        write_config(tiny_run)
    assert {r for r, s in styles.items() if s == {"solid"}} == set(FROM_TRAINING)
    # everything upstream stays dashed (the graph holds only the jobs the targets need)
    assert styles["tokenize_conversations"] == styles["preflight"] == {"dashed"}


@pytest.mark.slow
def test_eval_setting_reruns_only_evaluation(tiny_run):
    assert planned_with(tiny_run, eval__max_new_tokens=12) == {"evaluate_draft": 1, "all": 1}


@pytest.mark.slow
def test_vllm_evaluation_and_environment_rerun_no_extraction(tiny_run):
    """Asking for the vLLM evaluation, or pointing at another vLLM environment or GPU size, reruns
    neither preflight nor what depends on it: only the new evaluation is planned, with the job
    that compiles the target's PTX-only vLLM kernels beside it (`all` asks for its kernels.json)."""
    jobs = planned_with(
        tiny_run, eval__vllm=True, vllm__gpu_memory_gib=40, vllm__python="/opt/vllm/bin/python"
    )
    assert jobs == {"compile_kernels": 1, "evaluate_vllm": 1, "all": 1}


@pytest.mark.slow
def test_extract_setting_reruns_extraction_not_preflight(tiny_run):
    jobs = planned_with(tiny_run, extract__max_tokens_per_batch=256)
    assert jobs == {"extract_engine": 1, "extract_hidden_states": 4, **FROM_TRAINING}


@pytest.mark.slow
def test_aux_ids_rerun_extraction_not_tokenization(tiny_run):
    jobs = planned_with(tiny_run, layers__aux_ids=[1, 3])
    assert (
        jobs["extract_hidden_states"] == 4
        and jobs["extract_engine"] == 1
        and jobs["preflight"] == 1
    )
    assert jobs["train_draft"] == 1
    assert "tokenize_conversations" not in jobs and "build_vocab_map" not in jobs
    assert "build_demo_target" not in jobs


@pytest.mark.slow
def test_edited_conversations_rerun_everything_downstream(tiny_run):
    convs = tiny_run / "convs.jsonl"
    original = convs.read_bytes()
    extra = {
        "messages": [
            {"role": "user", "content": "What does len do?"},
            {"role": "assistant", "content": "It returns the number of items."},
        ]
    }
    convs.write_bytes(original + (json.dumps(extra) + "\n").encode())
    try:
        jobs = planned(tiny_run)
    finally:
        convs.write_bytes(original)
    assert jobs == {
        "tokenize_conversations": 1,
        "build_vocab_map": 1,
        "preflight": 1,
        "extract_engine": 1,
        "extract_hidden_states": 4,
        **FROM_TRAINING,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, key",
    [
        ({"data__conversations": ["convs.jsonl", "conv.jsonl"]}, "data.conversations"),
        ({"eval__prompts": "question.jsnol"}, "eval.prompts"),
    ],
)
def test_a_misspelt_input_after_a_finished_run_is_one_line(tiny_run, tmp_path, override, key):
    """Snakemake runs no job whose outputs exist: a path that does not exist would pass as
    "Nothing to be done". Every input path is checked at each parse instead."""
    config = write_config(tmp_path, **override)
    proc = run_snakemake(tiny_run, "-n", configfiles=(config,), timeout=300)
    missing = next(iter(override.values()))
    missing = missing[-1] if isinstance(missing, list) else missing
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("eyrie")] == [
        f"eyrie config: error: {key}: {missing} not found (from {tiny_run}); fix the path, or "
        "give it relative to the working directory (snakemake -d)"
    ]


@pytest.mark.slow
def test_deleted_shard_rebuilds_alone_with_its_engine(tiny_run):
    shard = tiny_run / "results/tiny/hidden/shard_000.h5"
    saved = shard.with_suffix(".saved")
    shutil.copy2(shard, saved)
    shard.unlink()
    try:
        assert planned(tiny_run, "results/tiny/hidden/shard_000.h5") == {
            "extract_engine": 1,
            "extract_hidden_states": 1,
        }
    finally:
        shutil.move(saved, shard)


@pytest.mark.slow
@pytest.mark.parametrize("override", [{"extract__engine_wait_s": 5}, {"extract__group_size": 8}])
def test_scheduling_settings_rerun_nothing(tiny_run, override):
    """engine_wait_s and group_size change no shard's content (they are not in params); a larger
    group_size that keeps every shard in its group changes no input path either."""
    assert planned_with(tiny_run, **override) == {}


@pytest.mark.slow
def test_group_size_reruns_the_shards_that_change_group(tiny_run):
    """Shards 2 and 3 move from engine_000 to engine_001: their input list changed (Snakemake's
    `input` trigger), so they rerun with their new engine, and training after them."""
    write_config(tiny_run, extract__group_size=2)
    try:
        out = snakemake(tiny_run, "-n", "--list-changes", "input")
        jobs = planned(tiny_run)
    finally:
        write_config(tiny_run)
    assert jobs == {"extract_engine": 1, "extract_hidden_states": 2, **FROM_TRAINING}
    changed = re.findall(r"^results/tiny/hidden/(shard_\d+)\.h5$", out, re.M)
    assert sorted(changed) == ["shard_002", "shard_003"]


@pytest.mark.slow
def test_ten_thousand_shards_plan_in_a_dry_run(tmp_path):
    """The whole DAG of a 10,000-shard config plans (no rule lists the N tokenized shards, which
    made planning quadratic: BENCHMARKS.md "Workflow overhead"); each hidden-state shard is still
    its own job, 16 to an engine. No timing here: benchmarks/workflow_overhead.py measures it."""
    write_config(tmp_path, data__conversations=[], data__num_shards=10_000, extract__group_size=16)
    assert planned(tmp_path, "--quiet", "rules") == {
        "build_demo_conversations": 1,
        "build_demo_target": 1,
        "tokenize_conversations": 1,
        "build_vocab_map": 1,
        "preflight": 1,
        "extract_engine": 625,
        "extract_hidden_states": 10_000,
        **FROM_TRAINING,
    }


@pytest.mark.slow
def test_rerun_after_deleting_two_shards_loads_once_and_builds_only_those(tiny_run, tmp_path):
    """A real rerun (on a copy, so the dry runs above keep their state): one engine job, one
    model load, the two deleted shards; the other shards are not touched."""
    work = tmp_path / "wf"
    copy_run(tiny_run, work)
    # without the output store (which would restore them:
    # tests/workflow/test_reliability_outputs.py)
    write_config(work, store__path=None)
    shards = [work / f"results/tiny/hidden/shard_{i:03d}.h5" for i in range(4)]
    before = [p.stat().st_mtime_ns for p in shards]
    shards[1].unlink()
    shards[3].unlink()
    out = snakemake(work, *(str(p.relative_to(work)) for p in shards))
    assert job_table(out) == {"extract_engine": 1, "extract_hidden_states": 2}
    assert [p.stat().st_mtime_ns for p in (shards[0], shards[2])] == [before[0], before[2]]
    assert shards[1].is_file() and shards[3].is_file()
    log = engine_log(work)
    assert log.count("engine: loaded target") == 1
    assert served_shards(log) == ["shard_001", "shard_003"]
    assert planned(work, *(str(p.relative_to(work)) for p in shards)) == {}


# A stand-in for a vLLM engine that is slow to stop: the real `eyrie`, whose extract-engine takes
# 8 s to exit after Snakemake's SIGTERM, longer than Snakemake's default 5 s latency wait.
SLOW_STOPPING_ENGINE = """#!/usr/bin/env bash
if [[ " $* " != *" extract-engine "* ]]; then exec {eyrie} "$@"; fi
{eyrie} "$@" &
child=$!
trap 'kill -TERM $child; wait $child; sleep 8; exit 143' TERM
wait $child
"""


def python_with(tmp_path: Path, name: str, script: str) -> Path:
    """A Python environment over this one whose bin/ also holds `name` (the workflow puts the bin/
    of the Python running Snakemake first on the PATH of its jobs)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    parent = next(Path(sys.executable).parent.parent.glob("lib/python3*/site-packages"))
    (site / "parent.pth").write_text(f"import site; site.addsitedir({str(parent)!r})\n")
    (venv / "bin" / name).write_text(script)
    (venv / "bin" / name).chmod(0o755)
    return venv / "bin" / "python"


@pytest.mark.slow
def test_a_service_slow_to_stop_deletes_no_shard(tiny_run, tmp_path):
    """The engine is a Snakemake service: terminated once its shard jobs are done, and not
    waited for. The group job must succeed and keep its shard however long the engine takes to
    exit (with a benchmark: file on the service, Snakemake waited 5 s for it, failed the group
    with MissingOutputException and deleted the good shard)."""
    work = tmp_path / "wf"
    copy_run(tiny_run, work)
    eyrie = Path(sys.executable).parent / "eyrie"
    python = python_with(tmp_path, "eyrie", SLOW_STOPPING_ENGINE.format(eyrie=eyrie))
    shard = work / "results/tiny/hidden/shard_002.h5"
    shard.unlink()
    shutil.rmtree(work / "results/tiny/benchmarks")  # as in a first run
    out = snakemake(work, str(shard.relative_to(work)), python=python)
    assert job_table(out) == {"extract_engine": 1, "extract_hidden_states": 1}
    assert shard.is_file() and "MissingOutputException" not in out
    assert planned(work) == {}


@pytest.mark.slow
def test_regeneration_reruns_tokenization_on_the_targets_responses(tiny_run, tmp_path):
    """data.regenerate switched on for a finished run (on a copy): the target preflight and one
    regenerate job per shard, then tokenization from their files; nothing else before it."""
    work = tmp_path / "wf"
    copy_run(tiny_run, work)
    write_config(
        work, data__regenerate=True, regenerate__num_shards=2, regenerate__max_new_tokens=16
    )
    report = "results/tiny/tokenized/report.json"
    out = snakemake(work, report)
    assert job_table(out) == {
        "preflight_regenerate": 1,
        "regenerate_responses": 2,
        "tokenize_conversations": 1,
    }
    lines = [
        json.loads(line)
        for s in ("000", "001")
        for line in (work / f"results/tiny/regenerated/shard_{s}.jsonl").read_text().splitlines()
    ]
    assert len(lines) == 60 and {x["status"] for x in lines} <= {"ok", "cut", "failed"}
    got = json.loads((work / report).read_text())
    summary = got["regenerated"]
    assert summary["records_used"] + summary["cut"] + summary["failed"] > 0
    assert got["dropped_by_reason"].get("regenerate_cut", 0) == summary["cut"]
    assert planned(work, report) == {}


def test_question_file_is_a_tracked_input_of_the_evaluation(tmp_path):
    """eval.prompts adds tokenize_eval_prompts with the question file as an input, and its output
    is the eval set of evaluate_draft: a newer or edited question file reruns both (Snakemake's
    mtime and input triggers); without eval.prompts the eval set stays eval.parquet."""
    write_config(tmp_path, data__conversations=[], eval__prompts="question.jsonl")
    (tmp_path / "question.jsonl").write_text('{"question_id": 1, "turns": ["hello"]}\n')
    out = snakemake(tmp_path, "-n")
    jobs = {m[1]: m[2] for m in re.finditer(r"rule (\w+):\n(.*?)\n\n", out, re.S)}
    assert re.search(r"input: .*question\.jsonl", jobs["tokenize_eval_prompts"])
    assert "output: results/tiny/eval/prompts.parquet" in jobs["tokenize_eval_prompts"]
    assert re.search(r"input: .*results/tiny/eval/prompts\.parquet", jobs["evaluate_draft"])
    write_config(tmp_path, data__conversations=[])
    out = snakemake(tmp_path, "-n")
    assert "tokenize_eval_prompts" not in out and "results/tiny/tokenized/eval.parquet" in out

"""Nothing good lost, nothing stale kept: the target tracked by content, the output store, the
versioned drafts, and the legal values that used to crash (docs/reliability.md has the table;
the store's own cases are in tests/store/test_store.py).

Real Snakemake runs on the tiny config with a user target in a folder whose path has a space;
each test constructs the fault and checks what reruns, what is kept and what the user reads."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from eyrie.cli import main as cli_main
from eyrie.core.errors import ExportError
from eyrie.export.export import export
from eyrie.formats.draft import load_draft
from eyrie.formats.versions import DraftVersions
from eyrie.store.store import Store
from eyrie.train.recipe import train
from tests.support import REPO
from tests.support.train_helpers import build_world, train_paths, train_settings, write_shard
from tests.support.workflow import (
    copy_run,
    job_table,
    planned,
    run_snakemake,
    snakemake,
    write_config,
)

TARGET_RULES = {  # what replaced weights rerun: everything that reads them, not tokenization
    "preflight": 1,
    "extract_engine": 1,
    "extract_hidden_states": 4,
    "train_draft": 1,
    "export_draft": 1,
    "evaluate_draft": 1,
    "all": 1,
}


def _same_mtime_copy(src_bytes: bytes, dest: Path) -> None:
    """Replace `dest` in place as `cp -p` of an older file would: new bytes, old mtime."""
    st = dest.stat()
    dest.write_bytes(src_bytes)
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture(scope="module")
def user_run(tiny_run, tmp_path_factory):
    """The tiny workflow, run to completion against a user target: the demo target of the
    session's tiny run (tests/conftest.py) copied into "my target/", a path with a space."""
    work = tmp_path_factory.mktemp("user")
    shutil.copy2(tiny_run / "convs.jsonl", work / "convs.jsonl")
    shutil.copytree(tiny_run / "results/tiny/target", work / "my target")
    write_config(work, target__path="my target")  # relative: the copies below keep their params
    snakemake(work)
    return work


@pytest.mark.slow
def test_a_target_path_with_a_space_runs_and_reruns_nothing(user_run):
    assert (user_run / "results/tiny/eval/eval.json").is_file()
    assert planned(user_run) == {}


@pytest.mark.slow
def test_weights_replaced_in_place_rerun_what_reads_them(user_run, tmp_path):
    """Before: only config.json and tokenizer_config.json were tracked, so other weights of the
    same shape, copied with their old mtime, left "Nothing to be done"."""
    work = tmp_path / "wf"
    copy_run(user_run, work)
    weights = work / "my target/model.safetensors"
    tensors = load_file(str(weights))
    tensors = {k: v + 0.01 for k, v in tensors.items()}  # a fine-tune: same names and shapes
    other = tmp_path / "other.safetensors"
    save_file(tensors, str(other))
    os.utime(weights)  # touched: new mtime and ctime, the same content
    assert planned(work) == {}
    _same_mtime_copy(other.read_bytes(), weights)
    assert planned(work) == TARGET_RULES


@pytest.mark.slow
def test_a_changed_tokenizer_reruns_tokenization(user_run, tmp_path):
    work = tmp_path / "wf"
    copy_run(user_run, work)
    tok = work / "my target/tokenizer.json"
    spec = json.loads(tok.read_text())
    spec.setdefault("added_tokens", [])
    tok.write_text(json.dumps(spec, indent=1))  # same tokenizer, other bytes
    plan = planned(work)
    assert plan.get("tokenize_conversations") == 1 and plan.get("build_vocab_map") == 1


@pytest.mark.slow
def test_reverted_setting_restores_shards_without_loading_the_target(user_run, tmp_path):
    """Before: a bad layers.aux_ids run, reverted, reran every extraction job. Now the shards
    come back from the store, the engine loads nothing, training resumes its finished run."""
    work = tmp_path / "wf"
    copy_run(user_run, work)
    store = Store(work / "results/store")
    kept = len(store.entries())
    assert kept == 4  # the four shards of the first run
    write_config(work, target__path="my target", layers__aux_ids=[1, 2])
    snakemake(work)
    assert len(store.entries()) == 8
    write_config(work, target__path="my target")
    out = snakemake(work)
    assert job_table(out)["extract_hidden_states"] == 4
    logs = "".join(
        (work / f"logs/tiny/extract_hidden_states/shard_{i:03d}.log").read_text() for i in range(4)
    )
    assert logs.count("store: restored") == 4
    engine = (work / "logs/tiny/extract_engine/engine_000.log").read_text()
    assert "engine: listening" in engine  # the engine job ran, asked for nothing, loaded nothing
    assert "engine: request" not in engine and "engine: loaded target" not in engine
    assert "resumed from" in (work / "logs/tiny/train_draft.log").read_text()
    assert planned(work) == {}


@pytest.mark.slow
def test_a_failed_export_keeps_the_draft_vllm_serves(user_run, tmp_path):
    """Before: Snakemake deleted draft/config.json and model.safetensors before the export ran,
    so a failed export took away the draft `vllm serve` used."""
    work = tmp_path / "wf"
    copy_run(user_run, work)
    draft = work / "results/tiny/draft"
    good = draft.resolve()
    summary = work / "results/tiny/train/train.json"
    broken = json.loads(summary.read_text())
    broken["target"]["fingerprint"] = "0" * 16
    summary.write_text(json.dumps(broken))
    proc = run_snakemake(work, "--cores", "2", "-f", "results/tiny/draft.json")
    assert proc.returncode != 0
    assert "the draft was trained for target fingerprint" in proc.stdout + proc.stderr
    assert not (work / "results/tiny/draft.json").exists()
    assert draft.resolve() == good
    assert load_draft(draft).config.speculators_config.proposal_methods[0].speculative_tokens == 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    world = build_world(root, num_conversations=8)
    settings = train_settings(epochs=1, ttt_steps=2)
    paths = train_paths(world, root)
    train(paths, settings)
    return world, root / "train", settings


@pytest.mark.parametrize("K", [1, 20])
def test_export_at_any_k(trained, tmp_path, K):
    """Before: K = 20 (train.ttt_steps: 20) failed in the export's own check batch, whose
    documents were shorter than K."""
    world, train_dir, settings = trained
    got = export(world["target"], train_dir, tmp_path / "draft", settings, num_speculative_tokens=K)
    assert got["num_speculative_tokens"] == K
    config = json.loads((tmp_path / "draft/config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K


def test_draft_versions_link_the_newest_good_and_keep_three(trained, tmp_path):
    world, train_dir, settings = trained
    link = tmp_path / "draft"
    firsts = []
    for K in (1, 2, 3, 4):
        export(world["target"], train_dir, link, settings, num_speculative_tokens=K)
        firsts.append(link.resolve())
    versions = DraftVersions(link).versions()
    assert len(versions) == 3 and link.resolve() == firsts[-1] and firsts[0] not in versions
    assert os.readlink(link).startswith("drafts/")  # relative: the results folder can move
    with pytest.raises(ExportError):
        export(world["target"], tmp_path / "no-train", link, settings, num_speculative_tokens=5)
    assert link.resolve() == firsts[-1] and (link / "model.safetensors").is_file()
    # a draft folder from an older eyrie becomes a version instead of being replaced
    old = tmp_path / "old/draft"
    shutil.copytree(firsts[-1], old)
    export(world["target"], train_dir, old, settings, num_speculative_tokens=2)
    assert old.is_symlink() and any(
        p.name.startswith("folder-") for p in (old.parent / "drafts").iterdir()
    )


def test_truncated_weights_fail_preflight_in_seconds(tmp_path, capsys):
    """Before: a truncated weight file passed preflight and failed only when the GPU engine
    loaded it (after ~18 minutes on a large target)."""
    world = build_world(tmp_path, num_conversations=4)
    weights = next(Path(world["target"]).glob("*.safetensors"))
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 100)
    rc = cli_main(
        [
            "preflight",
            "--target",
            str(world["target"]),
            "--out",
            str(tmp_path / "pf.json"),
            "--settings",
            json.dumps({"layers": {"aux_ids": [1, 2, 3]}}),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and not (tmp_path / "pf.json").exists()
    line = next(ln for ln in err.splitlines() if "model" in ln and "safetensors" in ln)
    assert f"{weights}: {size - 100:,} bytes, but its header says {size:,} (truncated)" in line
    assert "copy the file again" in line


def parse_error_lines(workdir) -> list[str]:
    """`snakemake -n` on `workdir`, which must stop without a traceback: its `eyrie` lines."""
    proc = run_snakemake(workdir, "-n")
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("eyrie")]


def test_a_template_switch_the_target_never_reads_is_one_line_at_parse_time(tmp_path):
    """A user's target whose template reads enable_thinking, and the config says
    enable_thinkin: the dry run stops on one line before any job (it trained on renderings
    without the switch)."""
    from transformers import AutoTokenizer

    from tests.support.models import config_only_llama
    from tests.support.template_cases import standin_target

    target = standin_target(tmp_path / "qwen3", "qwen3")
    config_only_llama(target, len(AutoTokenizer.from_pretrained(target)))
    (tmp_path / "convs.jsonl").touch()
    kwargs = {"enable_thinkin": False}
    write_config(tmp_path, target__path=str(target), data__chat_template_kwargs=kwargs)
    assert parse_error_lines(tmp_path) == [
        "eyrie config: error: data.chat_template_kwargs.enable_thinkin: the chat template never "
        "reads it (it reads content, enable_thinking, reasoning_content); fix the spelling or "
        "remove it"
    ]
    write_config(tmp_path, target__path=str(target), data__chat_template_kwargs={})
    assert run_snakemake(tmp_path, "-n").returncode == 0


@pytest.mark.parametrize("key", ["store", "cache"])
def test_a_store_or_cache_path_naming_a_file_is_one_line_at_parse_time(tmp_path, key):
    """store.path (or cache.path) naming a file was a warning in each job's log, and nothing
    kept; now the dry run stops on one line."""
    (tmp_path / "convs.jsonl").touch()
    (tmp_path / "a file").write_text("x")
    write_config(tmp_path, **{f"{key}__path": str(tmp_path / "a file")})
    assert parse_error_lines(tmp_path) == [
        f"eyrie config: error: {key}.path: {tmp_path / 'a file'} is a file, not a folder; name "
        "a folder (made when missing), or null to keep nothing"
    ]


def test_a_missing_target_folder_is_one_line_at_parse_time(tmp_path):
    write_config(tmp_path, target__path=str(tmp_path / "no such model"))
    (tmp_path / "convs.jsonl").touch()
    assert parse_error_lines(tmp_path) == [
        f"eyrie config: error: target.path {tmp_path / 'no such model'}: not a folder; set it "
        "to a Hugging Face model folder (config.json, safetensors weights, tokenizer)"
    ]
    assert not (tmp_path / "results").exists()


def test_reliability_docs_name_real_tests_and_count_their_rows():
    """docs/reliability.md: every test it names exists, and its figure counts its rows."""
    text = (REPO / "docs" / "reliability.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| case")]
    named = re.findall(r"`(tests/(?:\w+/)*\w+\.py)::(\w+)`", text)
    assert rows and named
    for path, name in named:
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{path}::{name}"
    figure = re.search(r"Now: \*\*(\d+) cases tried", text)
    assert figure and int(figure[1]) == len(rows)


def test_a_shard_and_a_draft_are_fsynced_before_their_names_publish_them(
    trained, tmp_path, monkeypatch
):
    """Before: nothing was fsynced before the rename, so a power loss could leave a complete
    name over incomplete bytes."""
    from eyrie.formats import hidden

    events = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename
    monkeypatch.setattr(
        os,
        "fsync",
        lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd),
    )
    monkeypatch.setattr(
        os, "replace", lambda a, b: events.append(("rename", str(b))) or real_replace(a, b)
    )
    monkeypatch.setattr(
        os, "rename", lambda a, b: events.append(("rename", str(b))) or real_rename(a, b)
    )
    world, train_dir, settings = trained
    out = tmp_path / "shard.h5"
    samples = world["samples"][:2]
    write_shard(out, world["model"], samples, hidden.ShardMeta(**world["meta"]), ["a:1", "a:2"])
    renamed = events.index(("rename", str(out)))
    assert any(kind == "fsync" and ".shard.h5" in p for kind, p in events[:renamed])
    assert ("fsync", str(tmp_path)) in events[renamed:]
    events.clear()
    link = tmp_path / "draft"
    export(world["target"], train_dir, link, settings)
    published = events.index(("rename", str(link)))
    synced = [p for kind, p in events[:published] if kind == "fsync"]
    assert any(p.endswith("model.safetensors") for p in synced)
    assert ("fsync", str(tmp_path)) in events[published:]


def test_what_a_killed_engine_left_beside_a_shard_goes_when_the_shard_is_restored(
    tmp_path, monkeypatch
):
    """A killed engine's temporary shard (`.shard_000.h5.tmp-<pid>`) is removed by the shard's
    next job, also when that job restores the shard from the store and writes nothing."""
    from argparse import Namespace

    from eyrie.extract import extract

    out = tmp_path / "hidden" / "shard_000.h5"
    out.parent.mkdir()
    out.write_bytes(b"states")
    Store(tmp_path / "store").put("hidden", "12" * 32, {"shard.h5": out}, {"why": "test"})
    out.unlink()
    stale = out.with_name(".shard_000.h5.tmp-4242")
    stale.write_bytes(b"half a shard")
    monkeypatch.setenv("EYRIE_STORE", str(tmp_path / "store"))
    monkeypatch.setattr(extract, "store_key", lambda *a: ("12" * 32, {}))
    args = Namespace(out=str(out), shard="s", preflight="p", settings={}, engine="sock")
    assert extract.run(args) == 0
    assert out.read_bytes() == b"states" and not stale.exists()


@pytest.mark.slow
def test_a_deleted_draft_version_is_named_at_parse_time(user_run, tmp_path):
    """Before: deleting the version draft.json names left "Nothing to be done" and a draft.json
    (and a `draft` link) naming a draft that no longer exists."""
    work = tmp_path / "wf"
    copy_run(user_run, work)
    version = json.loads((work / "results/tiny/draft.json").read_text())["version"]
    shutil.rmtree(work / version)
    proc = run_snakemake(work, "-n")
    assert proc.returncode == 0
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("eyrie")] == [
        f"eyrie config: warning: results/tiny/draft.json names the draft {version}, which is "
        "gone; export it again with snakemake --forcerun export_draft"
    ]


@pytest.mark.slow
def test_a_failed_rerun_names_where_the_last_good_report_is(user_run, tmp_path):
    """Snakemake deletes a job's outputs before it runs: a preflight that now fails took
    preflight.json away. Its last good copy is kept beside it and the failure line names it."""
    work = tmp_path / "wf"
    copy_run(user_run, work)
    good = (work / "results/tiny/preflight.json").read_text()
    write_config(work, target__path="my target", layers__aux_ids=[1, 2, 40])
    proc = run_snakemake(work, "--cores", "2")
    assert proc.returncode != 0
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("failed rule preflight:")]
    assert line.endswith(
        "; the last good preflight.json is kept as results/tiny/.last-good/preflight.json"
    ), line
    assert not (work / "results/tiny/preflight.json").exists()
    assert (work / "results/tiny/.last-good/preflight.json").read_text() == good


@pytest.mark.slow
def test_the_same_target_under_another_path_reruns_nothing(user_run, tmp_path):
    """Before: target.path switched to a symlink or a copy of the same folder replanned the 8
    jobs whose params hold the path. Now the params compare the path the content was first
    given as; the shell gets the folder as it is now. Changed content still reruns."""
    work = tmp_path / "wf"
    copy_run(user_run, work)
    (work / "link").symlink_to(work / "my target")
    shutil.copytree(work / "my target", work / "copy")
    for path in ("link", "copy", str(work / "copy")):
        write_config(work, target__path=path)
        assert planned(work) == {}, path
    (work / "copy/tokenizer_config.json").write_text(
        (work / "copy/tokenizer_config.json").read_text().replace("}", ', "x": 1}', 1)
    )
    assert "tokenize_conversations" in planned(work)

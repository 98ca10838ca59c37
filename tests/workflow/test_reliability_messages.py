"""What users see when something fails: one line per problem, naming the file, record or key
and the fix. Each test makes the real fault (a rule that fails, a bad config, a read-only or
full folder, a model folder without tokenizer files) and checks the exact line."""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import yaml

from eyrie import cli
from eyrie.chat.template import load_chat_tokenizer
from eyrie.config.schema import (
    config_file,
    config_warnings,
    read_config,
    validate_config,
    workflow_config,
)
from eyrie.core.errors import ConfigError, DataError
from eyrie.core.failures import failure_lines
from tests.support import REPO, stages
from tests.support.workflow import TINY, run_snakemake

SETTINGS = json.dumps(stages.DEMO)
NO_TOKENIZER = (
    "no tokenizer files (looked for tokenizer.json, *.model, vocab.json, vocab.txt, *.tiktoken); "
    "copy the model's tokenizer files into this folder, or set target.path to the folder that "
    "has them"
)
# What Snakemake itself prints before the Snakefile's own lines (Snakemake 9.27).
SNAKEMAKE_PREAMBLE = (
    "Using workflow specific profile",
    "Config file",  # "... /config/config.yaml is extended by additional config ..."
)


def snakemake(workdir: Path, config: dict, *args: str) -> subprocess.CompletedProcess:
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_snakemake(workdir, *args, timeout=300)


def model_without_tokenizer(folder: Path) -> Path:
    """A model folder with its config files but none of the files a tokenizer is built from."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return folder


# ----------------------------------------------------------------------------- failed rules


@pytest.mark.slow
def test_failed_rule_ends_the_run_with_its_eyrie_line(tmp_path):
    model = model_without_tokenizer(tmp_path / "model")
    (tmp_path / "convs.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi?"}]}) + "\n"
    )
    config = {**TINY, "target": {"name": "tiny", "path": str(model)}}
    proc = snakemake(tmp_path, config, "-c1")
    assert proc.returncode == 1
    lines = (proc.stdout + proc.stderr).splitlines()
    log = "logs/tiny/tokenize_conversations.log"
    line = (
        f"failed rule tokenize_conversations: eyrie tokenize: error: {model}: {NO_TOKENIZER} "
        f"(log: {log})"
    )
    # After it, Snakemake's own last lines: "Complete log(s): ...", "Elapsed time: ...",
    # "WorkflowError:", "At least one job did not complete successfully."
    assert lines[-5] == line, "\n".join(lines[-12:])
    assert f"Logfile {log}:" in lines  # show-failed-logs: the log under Snakemake's report
    assert (tmp_path / log).read_text().strip() == f"eyrie tokenize: error: {model}: {NO_TOKENIZER}"


def test_failure_lines_give_each_jobs_eyrie_error_and_log(tmp_path):
    logs = {
        "user": "INFO starting\neyrie vocab: error: x.parquet: column missing; rerun tokenize\n",
        "several": (
            "eyrie preflight: error: preflight found 2 problem(s) for /m:\n"
            "  /m: no *.safetensors weights found; point target.path at a model folder\n"
            "  /m: tokenizer has no chat template; add chat_template.jinja\n"
        ),
        "bug": (
            "2026-01-01 10:00:00,000 eyrie.cli ERROR eyrie train: unexpected KeyError: 'x'\n"
            "Traceback (most recent call last):\n  File \"a.py\", line 1, in f\nKeyError: 'x'\n"
        ),
        "killed": "step 10 loss 1.5\nstep 20 loss 1.2\n",
        "shell": "bash: line 1: /no/venv/bin/python: No such file or directory\n",
    }
    for name, text in logs.items():
        (tmp_path / f"{name}.log").write_text(text)
    jobs = [(name, [str(tmp_path / f"{name}.log")]) for name in logs]
    jobs.append(("extract_hidden_states", [str(tmp_path / "never.log")]))
    assert failure_lines(jobs) == [
        f"failed rule user: eyrie vocab: error: x.parquet: column missing; rerun tokenize "
        f"(log: {tmp_path}/user.log)",
        "failed rule several: eyrie preflight: error: preflight found 2 problem(s) for /m: "
        "/m: no *.safetensors weights found; point target.path at a model folder (+1 more in "
        f"the log) (log: {tmp_path}/several.log)",
        f"failed rule bug: eyrie train: unexpected KeyError: 'x' (log: {tmp_path}/bug.log)",
        f"failed rule killed: no eyrie error in it (it ends: step 20 loss 1.2) (log: "
        f"{tmp_path}/killed.log); Snakemake's message above says why (e.g. killed, out of "
        "memory or time, outputs missing)",
        "failed rule shell: the shell could not run its command: bash: line 1: "
        f"/no/venv/bin/python: No such file or directory (log: {tmp_path}/shell.log); fix the "
        "path it names",
        f"failed rule extract_hidden_states: {tmp_path}/never.log not written (log: "
        f"{tmp_path}/never.log); Snakemake's message above says why (e.g. killed, out of "
        "memory or time, outputs missing)",
    ]


# ----------------------------------------------------------------------------- the config


def test_config_problems_are_one_line_each_without_traceback(tmp_path):
    bad = {
        **TINY,
        "target": {"name": ".."},
        "data": {**TINY["data"], "num_eval": 0},
        "train": {**TINY["train"], "seed": -1, "ttt_steps": 40, "bogus": 1},
    }
    proc = snakemake(tmp_path, bad, "-n")
    assert proc.returncode == 1
    where = tmp_path / "config.yaml"
    ours = [
        f"eyrie config: error: {where}: data.num_eval: 0 is less than the minimum of 1; the "
        "evaluation (evaluate_draft) takes its prompts from these held-out conversations; set "
        "data.num_eval to 1 or more",
        f"eyrie config: error: {where}: target.name: '..' is not allowed; use letters, digits, "
        "'.', '_' and '-', starting with a letter or digit (it names the folders "
        "results/<name>/ and logs/<name>/)",
        f"eyrie config: error: {where}: train.bogus: unknown key (allowed here: "
        "aux_ids, block_size, checkpoint_every, device, draft_arch, epochs, fsdp, hidden_noise, "
        "learning_rate, log_every, loss, lr_schedule, mask_token_id, max_grad_norm, "
        "max_tokens_per_batch, method, norm_before_fc, norm_before_residual, num_layers, "
        "pack_shape, packs_per_step, precision, report_to, sample_from_anchor, seed, "
        "ttt_step_loss_decay, ttt_steps, verify_shards, warmup_steps, weight_decay)",
        f"eyrie config: error: {where}: train.seed: -1 is less than the minimum of 0; give an "
        "integer from 0 to 4294967295",
        f"eyrie config: error: {where}: train.ttt_steps: 40 is greater than the maximum of 32; "
        "EAGLE-3 drafts use 3 to 8 tokens; beyond 32 almost no draft token is accepted",
        f"eyrie config: error: {where}: train.max_tokens_per_batch: 256 is too small for "
        "train.ttt_steps=40; set it to at least 320 (8 per TTT step) or lower train.ttt_steps",
    ]
    lines = (proc.stdout + proc.stderr).splitlines()
    assert [ln for ln in lines if ln.startswith("eyrie ")] == ours
    assert all(ln.startswith(SNAKEMAKE_PREAMBLE) for ln in lines if ln not in ours), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # nothing written


def test_a_key_is_named_with_the_file_that_sets_it(tmp_path, capsys):
    base, override = tmp_path / "base.yaml", tmp_path / "override.yaml"
    base.write_text(yaml.safe_dump({**TINY, "eval": {"num_prompts": 0}}))
    override.write_text(yaml.safe_dump({"target": {"name": "-x"}}))
    config = {**TINY, "eval": {"num_prompts": 0}, "target": {"name": "-x"}}
    with pytest.raises(SystemExit):
        workflow_config(config, [override, base], [override])  # Snakemake's order
    assert capsys.readouterr().err.splitlines() == [
        f"eyrie config: error: {base}: eval.num_prompts: 0 is less than the minimum of 1",
        f"eyrie config: error: {override}: target.name: '-x' is not allowed; use letters, "
        "digits, '.', '_' and '-', starting with a letter or digit (it names the folders "
        "results/<name>/ and logs/<name>/)",
    ]


def test_legal_names_and_bounds_pass():
    for name in ("demo", "Llama-3.1-8B_v2", "a..b", "7b"):
        cfg = {"target": {"name": name}, "train": {"seed": 2**32 - 1, "ttt_steps": 32}}
        assert validate_config({**cfg, "train": {**cfg["train"], "max_tokens_per_batch": 256}})
    for name in ("..", ".", ".hidden", "-x", "a/b", "", "a b"):
        with pytest.raises(ConfigError, match=r"target\.name: .* is not allowed; use letters"):
            validate_config({"target": {"name": name}})


def test_invalid_yaml_names_file_line_and_column(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text("target:\n  name: tiny\ndata: {num_eval: 3\ntrain:\n  epochs: 1\n")
    with pytest.raises(SystemExit):
        config_file(path)
    assert capsys.readouterr().err.splitlines() == [
        f"eyrie config: error: {path}:4:6: not valid YAML: expected ',' or '}}', but got ':' "
        "(while parsing a flow mapping from line 3, column 7); fix the syntax there (indent "
        "with spaces, never tabs; close every bracket and quote)"
    ]
    path.write_text("target:\n  name: tiny\n\tdata: 1\n")
    with pytest.raises(ConfigError) as err:
        read_config(path)
    assert str(err.value) == (
        f"{path}:3:1: not valid YAML: found character '\\t' that cannot start any token "
        "(while scanning for the next token); fix the syntax there (indent with spaces, never "
        "tabs; close every bracket and quote)"
    )


def test_an_empty_aux_ids_list_says_what_to_give():
    with pytest.raises(ConfigError) as err:
        validate_config({**TINY, "layers": {"aux_ids": []}})
    assert str(err.value).splitlines()[1:] == [
        "  layers.aux_ids: [] is not allowed; give the target layers whose hidden states the "
        "draft reads, as a list of integers (EAGLE-3 reads 3, e.g. [2, 16, 29]), or leave the key "
        "out for the default [2, N//2, N-3] of an N-layer target"
    ]


def test_short_packs_warn_at_parse_time_naming_both_keys(capsys):
    # tiny: data.max_seq_len 96, train.ttt_steps 3 -> a sample trains up to 95 positions, a
    # pack gives it max_tokens_per_batch - 2: no sample is cut from 97 up
    config = {**TINY, "train": {**TINY["train"], "max_tokens_per_batch": 97}}
    assert config_warnings(validate_config(config)) == []
    config = {**TINY, "train": {**TINY["train"], "max_tokens_per_batch": 64}}
    workflow_config(config)
    assert capsys.readouterr().err.splitlines() == [
        "eyrie config: warning: train.max_tokens_per_batch=64 with data.max_seq_len=96 and "
        "train.ttt_steps=3: training cuts every sample longer than 63 tokens to 63; set "
        "train.max_tokens_per_batch to at least 97 or data.max_seq_len to at most 63"
    ]


def test_more_prompts_than_held_out_conversations_warns():
    config = validate_config({**TINY, "eval": {**TINY["eval"], "num_prompts": 5}})
    assert config_warnings(config) == [
        "eval.num_prompts=5 is more than data.num_eval=4: the evaluation has at most 4 "
        "prompts; raise data.num_eval or lower eval.num_prompts"
    ]
    # with eval.prompts the prompts come from a question file, not the held-out conversations
    questions = {**TINY["eval"], "num_prompts": 5, "prompts": "question.jsonl"}
    assert config_warnings(validate_config({**TINY, "eval": questions})) == []


# ----------------------------------------------------------------------------- OS errors


def in_mount_namespace(options: str, script: str) -> subprocess.CompletedProcess:
    """`script` run by sh in a private mount namespace with a tmpfs (`options`) on $DIR: the
    real kernel error, and nothing of it outside the namespace."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare to mount a tmpfs in a private namespace")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:  # a container without CAP_SYS_ADMIN
        pytest.skip(f"cannot make a private mount namespace here: {probe.stderr.strip()}")
    folder = Path("/tmp") / f"eyrie-mnt-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    try:
        mount = f"mount -t tmpfs -o {options} tmpfs $DIR || exit 99\n"
        proc = subprocess.run(
            ["unshare", "-m", "sh", "-c", mount + script],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "DIR": str(folder), "PY": sys.executable},
        )
    finally:
        folder.rmdir()
    if proc.returncode == 99:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    return proc


DEMO = f"$PY -m eyrie.cli demo-conversations --settings '{SETTINGS}' --out $DIR/c.jsonl"


def test_read_only_folder_is_one_line():
    proc = in_mount_namespace("size=64k,ro", DEMO)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"eyrie demo-conversations: error: /tmp/eyrie-mnt-{os.getpid()}/c.jsonl: Read-only file "
        "system; run the workflow in a writable folder (snakemake -d DIR)"
    ]


def test_full_disk_is_one_line_and_keeps_the_previous_output():
    # a good previous output in a 16 KiB tmpfs: the new one (60 conversations) does not fit
    proc = in_mount_namespace(
        "size=16k",
        f"echo previous > $DIR/c.jsonl\n{DEMO}\necho rc=$?\ncat $DIR/c.jsonl\nls -A $DIR",
    )
    folder = f"/tmp/eyrie-mnt-{os.getpid()}"
    (line,) = proc.stderr.splitlines()  # the free space of that tmpfs: what "previous" left
    assert re.fullmatch(
        rf"eyrie demo-conversations: error: writing {folder}/c\.jsonl: No space left on device "
        r"\([\d.]+ \w+ free there\); free space on that disk, or run the workflow "
        r"where there is room \(snakemake -d\)",
        line,
    ), line
    assert proc.stdout.splitlines() == ["rc=2", "previous", "c.jsonl"]  # no temporary left


@pytest.mark.slow
def test_a_full_disk_during_extraction_names_the_shard_and_the_free_space(tmp_path):
    """The extraction engine and its client as the rules run them, the shard's folder a 32 KiB
    tmpfs: the client's line names the shard (not the writer's temporary, not nothing), the free
    space there and the fix, and no temporary is left on the full disk."""
    from tests.support.extract_helpers import build_case, extract_args
    from tests.support.extract_helpers import settings as extract_settings
    from tests.support.stages import eyrie_cmd

    target, shard, preflight, _, _ = build_case(tmp_path, "llama")
    cfg, sock = extract_settings(96), tmp_path / "engine.sock"
    out = Path("/tmp") / f"eyrie-mnt-{os.getpid()}" / "shard_000.h5"
    engine = eyrie_cmd(
        "extract-engine", socket=sock, target=target, preflight=preflight, settings=cfg
    )
    client = eyrie_cmd("extract", engine=sock, engine_wait_s=60, engine_log=tmp_path / "e.log")
    client += extract_args(target, shard, preflight, out, cfg)
    script = (
        f"{shlex.join(engine)} > {tmp_path / 'e.log'} 2>&1 &\nENGINE=$!\n"
        f"{shlex.join(client)}; echo rc=$?\nkill $ENGINE; wait; ls -A $DIR"
    )
    proc = in_mount_namespace("size=32k", script)
    assert proc.stdout.splitlines() == ["rc=2"], proc.stdout  # nothing left in the folder
    (line,) = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert line.startswith(f"eyrie extract: error: the engine at {sock} failed on {shard}: ")
    assert f": ExtractError: {out}: No space left on device (" in line, line
    assert re.search(r"\(([\d.]+ \w+|\d+ bytes) free there\); free space on that disk", line), line


def test_a_restore_onto_a_full_disk_leaves_no_temporary(tmp_path):
    """A store entry restored onto a full disk (another file system: copied, not linked): the
    restore is a miss that leaves nothing behind (its partial copy, 94 MB in the survey, stayed
    on the full disk), and the stage computes the output."""
    from eyrie.store.store import Store

    store, shard = Store(tmp_path / "store"), tmp_path / "shard.h5"
    shard.write_bytes(os.urandom(256 << 10))
    store.put("hidden", "0" * 64, {"shard.h5": shard}, {"why": "test"})
    code = (
        "import sys; from pathlib import Path; from eyrie.store.store import Store\n"
        f"got = Store(Path({str(store.root)!r})).restore('hidden', '0' * 64, "
        "{'shard.h5': Path(sys.argv[1]) / 'hidden' / 'shard_000.h5'})\nprint(got)"
    )
    proc = in_mount_namespace("size=64k", f"$PY -c {shlex.quote(code)} $DIR; ls -A $DIR/hidden")
    assert proc.stdout.splitlines() == ["False"], proc.stdout + proc.stderr
    assert "No space left on device" in proc.stderr  # the store's warning, logged


def test_store_verify_on_a_read_only_store_says_what_stays(tmp_path):
    """`eyrie store --verify` on a store mounted read-only: a damaged entry is named with why
    it stays and how to remove it (not "removed", then a workflow's fix), the good one is
    listed, and the exit status says damage is left."""
    from eyrie.store.store import Store

    store = Store(tmp_path / "store")
    for i in range(2):
        out = tmp_path / f"{i}.h5"
        out.write_bytes(b"states of a shard")
        store.put("hidden", f"{i}" * 64, {"shard.h5": out}, {"why": "test"})
    (store.entry("hidden", "1" * 64) / "shard.h5").unlink()
    script = (
        f"cp -a {store.root} $DIR/store && mount -o remount,ro $DIR || exit 98\n"
        "$PY -m eyrie.cli store --path $DIR/store --verify; echo rc=$?\n"
        "ls -d $DIR/store/hidden/*/* | xargs -n1 basename"
    )
    proc = in_mount_namespace("size=1m", script)
    assert proc.returncode == 0, proc.stderr
    relative = store.entry("hidden", "1" * 64).relative_to(store.root)
    damaged = f"/tmp/eyrie-mnt-{os.getpid()}/store/{relative}"
    lines = proc.stdout.splitlines()
    assert lines[0] == (
        f"{damaged}: damaged (shard.h5 is gone); not removed (Read-only file system): a "
        f"restore refuses it; remove it where the store can be written (rm -r {damaged})"
    )
    assert lines[1].startswith("hidden: 1 entries, ") and "rc=1" in lines
    assert sorted(lines[-2:]) == ["0" * 64, "1" * 64]  # nothing removed
    assert proc.stderr == ""


def test_permission_denied_is_one_line(tmp_path):
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (root without CAP_DAC_OVERRIDE obeys the mode)")
    probe = subprocess.run(
        ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:  # a container that may not change its capability bounding set
        pytest.skip(f"setpriv cannot drop CAP_DAC_OVERRIDE here: {probe.stderr.strip()}")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    proc = subprocess.run(
        # as root without the capability to override permissions: the folder's mode decides
        ["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m"]
        + ["eyrie.cli", "demo-conversations", "--settings", SETTINGS, "--out", f"{locked}/c"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"eyrie demo-conversations: error: {locked}/c: Permission denied; fix its permissions "
        "or owner (chmod/chown), or use a path you may read and write"
    ]


def test_quota_and_not_permitted_name_the_path_and_the_fix():
    # EDQUOT needs a file system with quotas and EPERM an immutable file: the errors as the
    # kernel reports them, through the CLI's own mapping
    args = Namespace(out="results/x/eval.json")
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert cli.os_error_line(quota, args) == (
        "writing results/x/eval.json: Disk quota exceeded; free space within your disk quota, "
        "or run the workflow on another file system"
    )
    perm = PermissionError(errno.EPERM, os.strerror(errno.EPERM), "results/x/.train.tmp-42/a.pt")
    assert cli.os_error_line(perm, args) == (
        "results/x/train/a.pt: Operation not permitted; fix its permissions or owner "
        "(chmod/chown), or use a path you may read and write"
    )
    assert cli.os_error_line(FileNotFoundError(errno.ENOENT, "gone", "x"), args) is None  # a bug


def test_a_full_disk_under_safetensors_is_one_line():
    """safetensors raises its own type, the errno only in its message: as a checkpoint of a
    Kimi-sized draft filled an H200 machine's disk (2026-12-04)."""
    from safetensors import SafetensorError

    full = SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )
    assert cli.os_error_line(full, Namespace(out_dir="results/k/train")) == (
        "writing results/k/train: No space left on device; free space on that disk, or run the "
        "workflow where there is room (snakemake -d)"
    )
    assert cli.os_error_line(SafetensorError("header too large"), Namespace()) is None


def test_a_full_disk_at_a_checkpoint_names_the_checkpoint(tmp_path, monkeypatch):
    """The same full disk during a checkpoint named `writing <--out-dir>`, a folder the
    checkpoint is not in; the line now names the step's folder under the state folder (the
    disk to free). safetensors' own error is raised by a stand-in save_file here."""
    import safetensors.torch
    import torch
    from safetensors import SafetensorError

    from eyrie.train.checkpoint import Checkpoints

    def full(*args, **kwargs):
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = tmp_path / "train_state" / "run"
    state.mkdir(parents=True)
    with pytest.raises(OSError) as err:
        Checkpoints(state, "run", [4]).save(model, optimizer, scheduler, {"step": 2, "epoch": 0})
    line = cli.os_error_line(err.value, Namespace(out_dir="results/k/train"))
    assert re.fullmatch(
        rf"{re.escape(str(state / 'step_00000002'))}: No space left on device \([\d.]+ \w+ free "
        r"there\); free space on that disk, or run the workflow where there is room "
        r"\(snakemake -d\)",
        line,
    ), line
    assert list(state.iterdir()) == []  # no temporary left


# ----------------------------------------------------------------------------- the tokenizer


def test_folder_without_tokenizer_files_is_one_line(tmp_path):
    from eyrie.preflight.checks import Check, check_tokenizer

    folder = model_without_tokenizer(tmp_path / "model")
    with pytest.raises(DataError) as err:
        load_chat_tokenizer(folder)
    assert str(err.value) == f"{folder}: {NO_TOKENIZER}"
    check = Check([], [])
    assert check_tokenizer(folder, False, check) is None
    assert check.problems == [f"{folder}: {NO_TOKENIZER}"]


def test_tokenizer_files_found_by_pattern_or_left_to_trusted_code(tmp_path):
    from eyrie.chat.template import tokenizer_files_problem

    folder = model_without_tokenizer(tmp_path / "model")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}})
    )
    # remote code reads whatever files it ships, but only runs when trusted
    assert tokenizer_files_problem(folder, trust_remote_code=False) == f"{folder}: {NO_TOKENIZER}"
    assert tokenizer_files_problem(folder, trust_remote_code=True) is None
    (folder / "tiktoken.model").write_bytes(b"")  # Kimi-K2's tiktoken ranks
    assert tokenizer_files_problem(folder) is None


def test_tokenizer_code_that_raises_on_import_is_one_line_naming_the_folder(tmp_path):
    """Trusted tokenizer code (Kimi-K2.5's, vendored) that raises when imported, as code does
    when a package it imports is missing: one line naming the folder and the error, not the
    loader's traceback."""

    folder = tmp_path / "kimi"
    shutil.copytree(Path(__file__).parents[1] / "remote_code" / "kimi_k25", folder)
    code = folder / "tokenization_kimi.py"
    code.write_text("raise ImportError(\"No module named 'blobfile'\")\n" + code.read_text())
    with pytest.raises(DataError) as err:
        load_chat_tokenizer(folder, trust_remote_code=True)
    message = str(err.value)
    assert message.startswith(f"{folder}: its tokenizer code raised ImportError: ")
    assert "blobfile" in message and "\n" not in message


def test_a_config_json_that_is_not_json_is_named_not_the_tokenizer(tmp_path):
    from tests.support.train_helpers import save_chat_target

    folder = save_chat_target(tmp_path / "model", ["hello there, how are you?"] * 10)
    (folder / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(Exception) as err:
        load_chat_tokenizer(folder)
    message = str(err.value)
    assert message.startswith(f"{folder / 'config.json'}: not valid JSON (")
    assert message.endswith("; re-save the model's config")
    assert "trust_remote_code" not in message and "tokenizer" not in message


# ----------------------------------------------------------------------------- the data


def test_a_cut_or_fake_gzip_input_is_one_line_naming_the_file(tmp_path):
    import gzip

    from eyrie.chat.inputs import read_records

    lines = "".join(
        json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(3000)
    ).encode()
    data = gzip.compress(lines)
    cut, fake = tmp_path / "cut.jsonl.gz", tmp_path / "fake.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    fake.write_bytes(b"plain text, not gzip\n")
    for path, why in ((cut, "Compressed file ended"), (fake, "Not a gzipped file")):
        with pytest.raises(DataError) as err:
            list(read_records(path))
        message = str(err.value)
        assert message.startswith(f"{path}: cannot be read") and why in message, message
        assert message.endswith("the file is cut short or is not gzip; copy or compress it again")


def test_records_all_cut_by_max_seq_len_offer_raising_it(tmp_path):
    from types import SimpleNamespace

    from eyrie.chat.inputs import RawRecord
    from eyrie.chat.records import RecordError
    from eyrie.data.collect import Tally
    from eyrie.data.tokenize import _require_enough

    tally = Tally(records_read=10)
    for i in range(10):
        err = RecordError("no_assistant_tokens_after_truncation", "the first assistant token ...")
        tally.drop(RawRecord("c.jsonl", i + 1, {}), err)
    cfg = SimpleNamespace(num_eval=4, num_shards=4, max_seq_len=64)
    with pytest.raises(DataError) as err:
        _require_enough(tally, cfg)
    assert "raise data.max_seq_len (now 64): 10 records have no assistant token within it" in str(
        err.value
    )


def test_regenerating_through_vllm_without_its_environment_fails_preflight(tmp_path):
    from eyrie.core.errors import PreflightError
    from eyrie.preflight.preflight import preflight
    from tests.support.train_helpers import save_chat_target

    folder = save_chat_target(tmp_path / "model", ["hello there, how are you?"] * 10)
    settings = {"regenerate": {"backend": "vllm"}, "vllm": {"python": str(tmp_path / "none")}}
    with pytest.raises(PreflightError) as err:
        preflight(folder, None, tmp_path, settings)
    assert (
        f"regenerate.backend: vllm: vllm.python={str(tmp_path / 'none')!r}: no vLLM environment "
        f"there ({tmp_path / 'none'} is not an executable file); run bash "
        "scripts/setup-vllm.sh" in str(err.value)
    )


def test_ctrl_c_is_one_line_and_the_next_run_redoes_incomplete_jobs(monkeypatch, capsys):
    from eyrie.data import vocab

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(vocab, "run", interrupted)
    assert (
        cli.main(["vocab", "--target", "t", "--shards", "s", "--out", "o", "--settings", "{}"])
        == 130
    )
    assert capsys.readouterr().err.splitlines() == [
        "eyrie vocab: error: interrupted (Ctrl-C); nothing it was writing looks complete, and "
        "the next snakemake run resumes"
    ]
    # the engine socket of a stopped run is marked incomplete: redone, not IncompleteFilesException
    profile = yaml.safe_load((REPO / "profiles" / "default" / "config.yaml").read_text())
    assert profile["rerun-incomplete"] is True


def test_an_unwritable_tensorboard_folder_is_one_line_before_training():
    script = (
        "$PY -c 'import os; from pathlib import Path; from eyrie.train.curves import _TensorBoard; "
        '_TensorBoard(Path(os.environ["DIR"]) / "run" / "tensorboard", 2)\'\n'
    )
    proc = in_mount_namespace("ro,size=1m", script)
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "eyrie.core.errors.EyrieError: /tmp/eyrie-mnt-{}/run/tensorboard: TensorBoard cannot write "
        "its event files there (Read-only file system); fix the folder's permissions or free "
        "space, or leave tensorboard out of train.report_to"
    ).format(last.split("eyrie-mnt-")[1].split("/")[0]), proc.stderr[-2000:]

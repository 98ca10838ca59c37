"""Config and stage settings: every error at once, each naming its key; defaults filled; the
table of which rule compares which key (eyrie.config.rules) and the parse-time setup."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from eyrie.config.rules import (
    CONDITIONS,
    TABLE,
    contracts_table,
    engine_sockets,
    prepare,
    rule_settings,
    runtime_settings,
    schema_keys,
    settings_param,
)
from eyrie.config.schema import (
    added_later,
    key_schema,
    load_config,
    load_settings,
    merge_settings,
    schema_default,
    settings_json,
    validate_config,
    vllm_uses,
)
from eyrie.core.errors import ConfigError
from eyrie.core.runtime import CACHES
from tests.support import REPO


def test_shipped_config_is_valid():
    cfg = load_config(REPO / "config" / "config.yaml")
    assert cfg["target"]["path"] is None and cfg["layers"]["aux_ids"] is None


def test_defaults_filled():
    cfg = validate_config(
        {
            "target": {"name": "x"},
            "data": {},
            "layers": {},
            "vocab": {},
            "extract": {},
            "train": {},
            "eval": {},
        }
    )
    assert cfg["train"]["ttt_steps"] == 3 and cfg["extract"]["storage_dtype"] == "bfloat16"


def test_config_yaml_gives_the_schemas_defaults():
    """One fact in one place: every value config/config.yaml writes out is the schema's default
    (a stage called without a key gets the same value as the workflow); target.name has none."""
    from eyrie.config.schema import key_schema

    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    differ = [
        (f"{section}.{key}", value, key_schema(f"{section}.{key}").get("default"))
        for section, values in cfg.items()
        for key, value in values.items()
        if f"{section}.{key}" != "target.name"
        and value != key_schema(f"{section}.{key}").get("default")
    ]
    assert differ == []


@pytest.mark.parametrize(
    "train,others,wants",
    [
        ({"method": "dspark"}, {}, []),  # K 3 of a dspark block of 8
        ({"method": "dflash", "block_size": 3}, {}, ["proposes 2 tokens per forward"]),
        (
            {"method": "dspark"},
            {"eval": {"vllm": True}, "vllm": {"rehearsal": True}},
            ["eval.vllm: true with train.method: dspark", "vllm.rehearsal: true with"],
        ),
        ({"method": "dflash", "sample_from_anchor": True}, {}, ["bonus token (0.22, 0.26)"]),
        ({"method": "eagle3", "block_size": 2}, {"eval": {"vllm": True}}, []),
        (
            {"aux_ids": [2, 9]},
            {"layers": {"aux_ids": [2, 5, 8]}},
            ["train.aux_ids: [2, 9] names layers [9] that layers.aux_ids [2, 5, 8] does not"],
        ),
        ({"aux_ids": [2, 8]}, {"layers": {"aux_ids": [2, 5, 8]}}, []),
        # several kinds: the vLLM evaluation serves the first; each block drafter's K is checked
        ({"method": ["eagle3", "dspark", "dflash"]}, {"eval": {"vllm": True}}, []),
        (
            {"method": ["dspark", "eagle3"]},
            {"eval": {"vllm": True}},
            ["eval.vllm: true with train.method: dspark: eyrie's vLLM evaluation serves EAGLE-3"],
        ),
        # DFlash through vLLM passed on a GPU: the run's draft may be one
        ({"method": ["dflash", "eagle3"]}, {"eval": {"vllm": True}}, []),
        ({"method": "dflash"}, {"eval": {"vllm": True}, "vllm": {"rehearsal": True}}, []),
        (
            {"method": ["eagle3", "dflash"], "block_size": 3},
            {},
            ["a dflash draft with train.block_size 3 proposes 2 tokens"],
        ),
        ({"method": ["eagle3", "eagle3"]}, {}, ["train.method"]),
        ({"method": []}, {}, ["train.method"]),
        ({"method": ["eagle3", "medusa"]}, {}, ["train.method"]),
    ],
)
def test_a_block_drafter_is_checked_when_the_config_is_read(train, others, wants):
    """What a block drafter cannot do yet, or cannot do at all, is one line per problem when
    the workflow reads the config (before any job): the vLLM evaluation and rehearsal (EAGLE-3
    and DFlash so far), K past the block's tokens, a DFlash draft that samples from its anchor."""
    cfg = {"target": {"name": "t"}, "train": train, **others}
    if "vllm" in others:
        cfg["extract"] = {"backend": "vllm"}
    if not wants:
        validate_config(cfg)
        return
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert f"{len(wants)} problem" in str(err.value) or len(wants) == 1
    for want in wants:
        assert want in str(err.value)


def test_several_kinds_leave_the_run_drafts_settings_as_they_were():
    """train.method listing kinds: the first is the run's draft, whose rules compare the text a
    run of that one kind recorded (listing more reruns none of its jobs); a stage given the
    list itself refuses it (the workflow trains each kind apart)."""
    from eyrie.config.drafts import draft_methods
    from eyrie.config.sections import TrainSettings
    from eyrie.core.errors import EyrieError

    one = validate_config({"target": {"name": "t"}})
    several = validate_config({"target": {"name": "t"}, "train": {"method": ["eagle3", "dspark"]}})
    methods = draft_methods(several["train"]["method"])
    assert methods == ["eagle3", "dspark"] and draft_methods("dflash") == ["dflash"]
    run_draft = {**several, "train": {**several["train"], "method": methods[0]}}
    for rule in ("train_draft", "export_draft"):
        assert settings_param(run_draft, rule) == settings_param(one, rule)
    with pytest.raises(EyrieError, match="train.method: .*a stage trains one kind"):
        TrainSettings.from_settings({"train": {"method": ["eagle3", "dspark"]}})


def test_all_errors_reported_each_naming_its_key():
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["train"]["learning_rate"] = -1
    cfg["extract"]["storage_dtype"] = "int8"
    cfg["layers"]["aux_ids"] = "2,4"
    cfg["vocab"]["draft_vocab"] = 10
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    text = str(err.value)
    assert "4 problems" in text
    for key in (
        "train.learning_rate",
        "extract.storage_dtype",
        "layers.aux_ids",
        "vocab.draft_vocab: unknown key",
    ):
        assert key in text


def test_invalid_config_fails_snakemake_parse(tmp_path):
    from tests.support.workflow import run_snakemake

    (tmp_path / "bad.yaml").write_text("train: {epochs: 0}\n")
    proc = run_snakemake(tmp_path, "-n", configfiles=(tmp_path / "bad.yaml",), timeout=120)
    assert proc.returncode != 0
    assert "train.epochs" in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- stage settings


def test_stage_settings_checked_by_the_schema_all_at_once():
    bad = {"train": {"epochs": 0, "lr": 1}, "vllm": {"dtype": "int4"}, "trust_remote_code": "yes"}
    with pytest.raises(ConfigError) as err:
        load_settings(bad, ["train", "eval"])
    text = str(err.value)
    for problem in (
        "eval: missing",
        "train.epochs: 0 is less than the minimum of 1",
        "train.lr: unknown key",
        "vllm.dtype: 'int4' is not one of",
        "trust_remote_code: 'yes' is not of type 'boolean'",
    ):
        assert problem in text
    assert "\n" not in text


def test_stage_settings_defaults_come_from_the_schema():
    loaded = load_settings({"demo": {"seed": 3}, "extract": {}})
    config = validate_config({"target": {"name": "t"}})
    assert loaded["demo"] == {**config["demo"], "seed": 3}
    assert loaded["extract"] == config["extract"] and loaded["trust_remote_code"] is False
    assert "train" not in loaded  # a section not given stays absent: the stage says what it needs
    assert schema_default("vllm.gpu_memory_utilization") == config["vllm"]["gpu_memory_utilization"]
    assert schema_default("extract.engine_wait_s") == config["extract"]["engine_wait_s"]


def test_schema_enums_are_the_code_registries():
    from eyrie.config.schema import REPORTERS
    from eyrie.extract.extractor import BACKENDS
    from eyrie.formats.codecs import STORAGE_DTYPES
    from eyrie.formats.draft import DRAFT_ARCHS
    from eyrie.vllm.adapters import PATHS

    def enum(key):
        return key_schema(key)["enum"]

    assert enum("extract.backend") == list(BACKENDS)
    assert sorted(enum("extract.storage_dtype")) == sorted(STORAGE_DTYPES)
    assert enum("train.draft_arch") == list(DRAFT_ARCHS)
    assert enum("vllm.extraction_path") == list(PATHS)
    assert key_schema("train.report_to")["items"]["enum"] == list(REPORTERS)


# ----------------------------------------------------------------------------- the settings table


def test_table_covers_every_schema_key_exactly_once():
    keys = [row.key for row in TABLE]
    assert len(keys) == len(set(keys)), [k for k in keys if keys.count(k) > 1]
    assert sorted(keys) == sorted(schema_keys())


def test_table_names_real_rules_and_conditions():
    rules = set(re.findall(r"^rule (\w+):", _rule_text(), re.M))
    for row in TABLE:
        for entry in (*row.compared, *row.read):
            name, _, when = entry.partition("?")
            assert name in rules, f"{row.key}: no rule {name!r}"
            assert not when or when in CONDITIONS, f"{row.key}: no condition {when!r}"
    # the rules build params.settings from the table, each its own (the engine's are its shards')
    text = _rule_text()
    built = re.findall(r'(?<!\w)settings\("(\w+)"\)', text)
    assert sorted(built) == sorted({e.partition("?")[0] for row in TABLE for e in row.compared})
    for rule, body in re.findall(r"^rule (\w+):\n(.*?)(?=^\S|\Z)", text, re.M | re.S):
        own = re.search(r'settings=settings\("(\w+)"\)', body)
        assert own is None or own.group(1) == rule
    # a rule made from another (`use rule`: a kind listed after the first in train.method)
    # compares what that one does
    derived = re.findall(r"^use rule (\w+) as (\w+) with:\n(.*?)(?=^\S|\Z)", text, re.M | re.S)
    assert derived
    for base, rule, body in derived:
        names = re.findall(r'settings=(?:also_)?settings\("(\w+)"\)', body)
        assert names in ([], [base]), (rule, names)


def _rule_text() -> str:
    return "\n".join(p.read_text() for p in sorted((REPO / "rules").glob("*.smk")))


def test_contracts_doc_is_the_generated_table():
    assert contracts_table() in (REPO / "docs" / "contracts.md").read_text(), (
        "docs/contracts.md is stale: run `python -m eyrie.config.rules --contracts`"
    )


# History, not a second list of the schema's `added: true` marks (which the first test below checks
# against it): the keys db3e96d's params did not have, left out of params at their defaults
NEW_EVAL_KEYS = ("dtype", "prompts", "temperature")
NEW_DATA_KEYS = (
    "mask_mode",
    "train_reasoning",
    "non_text",
    "regenerate",
    "chat_template_kwargs",
    "reasoning_parser",
)
NEW_TRAIN_KEYS = (
    "report_to",
    "loss",
    "lr_schedule",
    "hidden_noise",
    "norm_before_fc",
    "method",
    "block_size",
    "sample_from_anchor",
    "mask_token_id",
    "aux_ids",
    "fsdp",
)


def test_every_key_added_since_finished_runs_is_marked_added_in_the_schema():
    """A key db3e96d's params lacked and a rule now compares must be `added: true`, or adding it
    reran every finished run; and a key marked so must be one of them (or came later still:
    demo.device, vllm.rehearsal, vllm.max_num_batched_tokens)."""
    history = {
        *(f"eval.{k}" for k in NEW_EVAL_KEYS),
        *(f"data.{k}" for k in NEW_DATA_KEYS),
        *(f"train.{k}" for k in NEW_TRAIN_KEYS),
    }
    compared = {row.key for row in TABLE if row.compared}
    marked = {row.key for row in TABLE if added_later(row.key)}
    assert history & compared <= marked, sorted(history & compared - marked)
    later = {"demo.device", "vllm.rehearsal", "vllm.max_num_batched_tokens"}
    assert marked - history == later, sorted(marked - history)


def _old_settings(config: dict) -> dict:
    """Every rule's params.settings as db3e96d's rule files built them (the values finished runs
    recorded): the table must give the same text, or every finished run would rerun."""
    ext, vllm, trust = config["extract"], config["vllm"], config["target"]["trust_remote_code"]
    ev = {k: v for k, v in config["eval"].items() if k not in ("vllm", *NEW_EVAL_KEYS)}
    vllm_extract = ext["backend"] == "vllm"
    preflight = {
        "layers": config["layers"],
        "extract": {"storage_dtype": ext["storage_dtype"]},
        "trust_remote_code": trust,
    }
    if vllm_extract:
        preflight["extract"]["backend"] = "vllm"
        preflight["vllm"] = {k: vllm[k] for k in ("extraction_path", "tensor_parallel_size")}
    extract = {
        "extract": {k: v for k, v in ext.items() if k not in ("group_size", "engine_wait_s")},
        "layers": config["layers"],
        "trust_remote_code": trust,
    }
    if vllm_extract:
        keys = ("extraction_path", "tensor_parallel_size", "enforce_eager", "max_model_len")
        extract["vllm"] = {k: vllm[k] for k in keys}
    demo = config["demo"]
    # a new key is in the params only where the config changes it from the schema's default
    train = {
        k: v
        for k, v in config["train"].items()
        if k not in NEW_TRAIN_KEYS or v != schema_default(f"train.{k}")
    }
    return {
        "build_demo_conversations": {"demo": {k: demo[k] for k in ("seed", "num_conversations")}},
        "build_demo_target": {
            "demo": {k: v for k, v in demo.items() if k not in ("num_conversations", "device")}
        },
        "tokenize_conversations": {
            "data": {k: v for k, v in config["data"].items() if k not in NEW_DATA_KEYS},
            "trust_remote_code": trust,
        },
        "build_vocab_map": {"vocab": config["vocab"]},
        "preflight": preflight,
        "extract_hidden_states": extract,
        "train_draft": {"train": train},
        "export_draft": {"train": train},
        "evaluate_draft": {"eval": ev},
        "evaluate_vllm": {
            "eval": {k: v for k, v in ev.items() if k != "device"},
            "vllm": {
                k: vllm[k]
                for k in ("tensor_parallel_size", "enforce_eager", "max_model_len", "dtype")
            },
        },
    }


def _old_runtime(config: dict) -> dict:
    """preflight's --runtime: command text, not compared (what it reads may grow without a rerun:
    the engine lengths' keys came with issue 38)."""
    if config["extract"]["backend"] != "vllm" and not config["eval"]["vllm"]:
        return {}
    keys = ("python", "extraction_path", "tensor_parallel_size", "gpu_memory_gib")
    lengths = ("max_model_len", "max_num_batched_tokens")
    ev = config["eval"]
    return {
        "eval": {k: ev[k] for k in ("vllm", "max_new_tokens", "num_speculative_tokens")},
        "vllm": {k: config["vllm"][k] for k in (*keys, "gpu_memory_utilization", *lengths)},
    }


def _configs():
    tiny = yaml.safe_load((REPO / ".test" / "config.yaml").read_text())
    for raw in (yaml.safe_load((REPO / "config" / "config.yaml").read_text()), tiny):
        for backend, eval_vllm in (("hf", False), ("hf", True), ("vllm", False), ("vllm", True)):
            config = validate_config(raw)
            config["extract"]["backend"], config["eval"]["vllm"] = backend, eval_vllm
            yield config


@pytest.mark.parametrize("config", list(_configs()))
def test_params_text_is_the_one_finished_runs_recorded(config):
    for rule, old in _old_settings(config).items():
        assert settings_param(config, rule) == settings_json(old), rule
    assert settings_json(runtime_settings(config, "preflight")) == settings_json(
        _old_runtime(config)
    )


def test_compared_settings_hold_only_what_changes_the_extraction():
    config = validate_config({"target": {"name": "t"}})
    plain = rule_settings(config, "preflight")
    assert plain == {
        "layers": config["layers"],
        "extract": {"storage_dtype": "bfloat16"},
        "trust_remote_code": False,
    }
    assert runtime_settings(config, "preflight") == {}
    assert vllm_uses(merge_settings(plain, runtime_settings(config, "preflight"))) == []
    # vLLM evaluation asked for: checked at run time, but compared settings are unchanged, so
    # switching it on reruns neither preflight nor, through it, the extraction
    config["eval"]["vllm"] = True
    assert rule_settings(config, "preflight") == plain
    runtime = runtime_settings(config, "preflight")
    assert runtime["eval"] == {"vllm": True, "max_new_tokens": 64, "num_speculative_tokens": 3}
    checked = ("python", "extraction_path", "tensor_parallel_size", "gpu_memory_gib")
    lengths = ("max_model_len", "max_num_batched_tokens")  # the engines' lengths (preflight)
    read = (*checked, "gpu_memory_utilization", *lengths)
    assert runtime["vllm"] == {k: config["vllm"][k] for k in read}
    merged = merge_settings(plain, runtime)
    assert vllm_uses(merged) == ["eval"] and merged["layers"] == config["layers"]
    # vLLM extraction: the keys that change the states are compared; the environment is not
    config["extract"]["backend"] = "vllm"
    compared = rule_settings(config, "preflight")
    assert compared["extract"] == {"storage_dtype": "bfloat16", "backend": "vllm"}
    assert compared["vllm"] == {k: config["vllm"][k] for k in checked[1:3]}
    assert "python" not in compared["vllm"] and "gpu_memory_gib" not in compared["vllm"]
    merged = merge_settings(compared, runtime_settings(config, "preflight"))
    assert (
        vllm_uses(merged) == ["extract", "eval"]
        and merged["vllm"]["python"] == config["vllm"]["python"]
    )


# ----------------------------------------------------------------------------- parse-time setup


def test_prepare_puts_eyrie_on_the_path_and_makes_the_socket_placeholders(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.chdir(tmp_path)
    sockets = engine_sockets("results/t", [f"{i:03d}" for i in range(5)], 2)
    assert sockets == [f"results/t/hidden/engine_{g:03d}.sock" for g in range(3)]
    (tmp_path / "results/t/hidden").mkdir(parents=True)
    (tmp_path / sockets[0]).write_text("kept")
    prepare(str(REPO), "/venv/bin/python", sockets)
    assert os.environ["PATH"].split(os.pathsep)[-2:] == ["/venv/bin", "/usr/bin"]
    assert (tmp_path / sockets[0]).read_text() == "kept"
    assert all((tmp_path / s).read_text() == "" for s in sockets[1:])


PREPARE = """
import json, os, sys
from eyrie.config.rules import prepare
import torch._inductor.config  # sets TORCHINDUCTOR_CACHE_DIR, as the GPU image's Snakemake does
prepare(sys.argv[1], "/venv/bin/python", [], None, "results/cache")
names = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "HUMMING_CACHE_DIR")
print(json.dumps({v: os.environ.get(v) for v in names}))
"""


def test_prepare_puts_the_caches_under_cache_path_and_keeps_a_users_own(tmp_path, monkeypatch):
    """cache.path: each compilation cache of CACHES in its folder there, for every job; a
    variable the user set before Snakemake started wins, named in one line; one an import set
    since (torch's inductor: /tmp/torchinductor_<user>) does not; no cache.path sets none."""
    env = {k: v for k, v in os.environ.items() if k not in CACHES}
    env["TRITON_CACHE_DIR"] = "/mine/triton"
    proc = subprocess.run(
        [sys.executable, "-c", PREPARE, str(REPO)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "TRITON_CACHE_DIR": "/mine/triton",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "results/cache/inductor"),
        "HUMMING_CACHE_DIR": str(tmp_path / "results/cache/humming"),
    }
    assert "kept from the environment, outside it: TRITON_CACHE_DIR=/mine/triton (" in proc.stderr
    assert "TORCHINDUCTOR" not in proc.stderr
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    prepare(str(REPO), "/venv/bin/python", [], None, None)
    assert "VLLM_CACHE_ROOT" not in os.environ


def test_a_new_key_is_compared_only_away_from_its_default():
    config = validate_config({"target": {"name": "t"}})
    plain = settings_param(config, "tokenize_conversations")
    assert all(f'"{k}"' not in plain for k in NEW_DATA_KEYS)
    config["data"]["mask_mode"] = "per_turn"
    changed = settings_param(config, "tokenize_conversations")
    assert '"mask_mode":"per_turn"' in changed and changed != plain

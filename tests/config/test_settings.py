"""Settings take one way in: every stage's section is built the same way and reads what the rules
table gives its rules; the cross-field rules run once (the dry run and every stage say the same
words); reserved template keywords are the schema's."""

from __future__ import annotations

import inspect

import pytest

from eyrie.chat.keywords import RESERVED_KWARGS
from eyrie.config.rules import CONDITIONS, TABLE, rule_keys, rule_settings, runtime_settings
from eyrie.config.schema import (
    SETTINGS_ALIASES,
    cross_field_problems,
    key_schema,
    load_settings,
    validate_config,
)
from eyrie.config.sections import ExtractSettings, RegenSettings, TrainSettings
from eyrie.config.stages import (
    DataSettings,
    DemoConversationsSettings,
    DemoTargetSettings,
    EvalSettings,
    PreflightSettings,
    PromptSettings,
    VllmEvalSettings,
    VocabSettings,
)
from eyrie.core.errors import ConfigError, EyrieError

TOO_SMALL = (
    "train.max_tokens_per_batch: 16 is too small for train.ttt_steps=3; set it to at least 24 "
    "(8 per TTT step) or lower train.ttt_steps"
)


def test_a_stage_refuses_a_cross_field_rule_in_the_dry_runs_words():
    config = {"target": {"name": "t"}, "train": {"max_tokens_per_batch": 16, "ttt_steps": 3}}
    with pytest.raises(ConfigError, match="invalid configuration") as parsed:
        validate_config(config)
    assert TOO_SMALL in str(parsed.value)
    with pytest.raises(EyrieError) as staged:
        TrainSettings.from_settings({"train": config["train"]})
    assert str(staged.value) == f"invalid --settings: {TOO_SMALL}"


def test_a_rule_runs_on_a_stages_settings_only_with_every_section_it_reads():
    # a dflash block of 2 proposes 1 token; K=3 breaks the rule only where eval is given
    train = {"method": "dflash", "block_size": 2}
    assert load_settings({"train": train})["train"]["block_size"] == 2
    with pytest.raises(ConfigError, match="eval.num_speculative_tokens: 3 but a dflash draft"):
        load_settings({"train": train, "eval": {"num_speculative_tokens": 3}})
    full = validate_config({"target": {"name": "t"}, "eval": {"num_speculative_tokens": 1}})
    assert cross_field_problems({**full, "train": {**full["train"], **train}}) == []


def test_reserved_template_keywords_are_the_schemas():
    refused = key_schema("data.chat_template_kwargs")["propertyNames"]["not"]["enum"]
    assert sorted(refused) == sorted(RESERVED_KWARGS)


def test_a_reserved_template_keyword_is_refused_when_the_config_is_read():
    config = {"target": {"name": "t"}, "data": {"chat_template_kwargs": {"tokenize": True}}}
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    assert str(err.value).splitlines()[1].strip() == (
        "data.chat_template_kwargs.tokenize: set by eyrie for each rendering; remove it (the "
        "template switches are the template's own variables, e.g. enable_thinking)"
    )
    with pytest.raises(ConfigError, match="data.chat_template_kwargs.tokenize: set by eyrie"):
        load_settings({"data": config["data"]})


def test_a_reserved_template_keyword_fails_the_dry_run_in_one_line(tmp_path):
    from tests.support.workflow import run_snakemake

    (tmp_path / "bad.yaml").write_text("data: {chat_template_kwargs: {tokenize: true}}\n")
    proc = run_snakemake(tmp_path, "-n", configfiles=(tmp_path / "bad.yaml",), timeout=120)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line]
    assert len(lines) == 1 and "data.chat_template_kwargs.tokenize: set by eyrie" in lines[0]


# ----------------------------------------------------------------------------- sections and rules

# the section each rule's stage builds its settings into
SECTIONS = {
    "build_demo_conversations": DemoConversationsSettings,
    "build_demo_target": DemoTargetSettings,
    "tokenize_conversations": DataSettings,
    "build_vocab_map": VocabSettings,
    "regenerate_responses": RegenSettings,
    "preflight": PreflightSettings,
    "preflight_regenerate": PreflightSettings,
    "extract_hidden_states": ExtractSettings,
    "extract_engine": ExtractSettings,
    "train_draft": TrainSettings,
    "export_draft": TrainSettings,
    "tokenize_eval_prompts": PromptSettings,
    "evaluate_draft": EvalSettings,
    "evaluate_vllm": VllmEvalSettings,
}
# what a rule takes that its stage's section does not read, and why
BESIDE = {
    # compared, so that another list of files reruns; the stage reads them from --inputs
    "tokenize_conversations": {"data.conversations"},
    # the interpreter of the command (the vLLM environment)
    "regenerate_responses": {"vllm.python"},
    "extract_engine": {"vllm.python", "extract.engine_wait_s"},
    # the shard job's --engine-wait-s: how long it waits for its engine
    "extract_hidden_states": {"extract.engine_wait_s"},
}


def every_condition() -> dict:
    """A config under which every rule takes every key it can (each `?condition` holds)."""
    config = {
        "target": {"name": "t"},
        "extract": {"backend": "vllm"},
        "eval": {"vllm": True},
        "regenerate": {"backend": "vllm"},
    }
    config = validate_config(config)
    assert all(holds(config) for holds, _ in CONDITIONS.values())
    return config


def test_every_stage_section_is_built_one_way():
    for section in {*SECTIONS.values()}:
        assert list(inspect.signature(section.from_settings).parameters) == [
            "settings",
            "runtime",
        ], section.__name__


def test_each_rules_settings_are_what_its_section_reads():
    """rule_settings and runtime_settings of each rule (every condition holding) hold the keys
    its stage's section reads, besides BESIDE's; a section several rules share, between them."""
    config = every_condition()
    rules = {entry.partition("?")[0] for row in TABLE for entry in (*row.compared, *row.read)}
    assert rules == set(SECTIONS)
    taken: dict = {}
    for rule, section in SECTIONS.items():
        keys = rule_keys(config, rule) - BESIDE.get(rule, set())
        if rule == "extract_engine":  # its --settings are its shard jobs' (one engine, one key)
            keys |= rule_keys(config, "extract_hidden_states") - BESIDE["extract_hidden_states"]
        assert keys <= set(section.READS), (rule, sorted(keys - set(section.READS)))
        taken[section] = taken.get(section, set()) | keys
    for section, keys in taken.items():
        assert keys == set(section.READS), (section.__name__, sorted(set(section.READS) - keys))
    # what the table gives (the params text drops an added key at its default: the same value)
    for rule in SECTIONS:
        given = {*dotted(rule_settings(config, rule)), *dotted(runtime_settings(config, rule))}
        assert given <= rule_keys(config, rule), rule


def dotted(settings: dict) -> set[str]:
    aliases = {alias: key for key, alias in SETTINGS_ALIASES.items()}
    return {
        f"{name}.{key}" if isinstance(value, dict) else aliases[name]
        for name, value in settings.items()
        for key in (value if isinstance(value, dict) else [None])
    }


def test_the_demo_targets_shapes_are_refused_together_and_by_key():
    shapes = {"hidden_size": 30, "num_attention_heads": 4, "num_key_value_heads": 3}
    with pytest.raises(EyrieError) as err:
        DemoTargetSettings.from_settings({"demo": shapes})
    assert str(err.value) == (
        "invalid --settings: demo.hidden_size=30 is not divisible by demo.num_attention_heads=4; "
        "change one of them; demo.num_attention_heads=4 is not divisible by "
        "demo.num_key_value_heads=3; change one of them"
    )
    with pytest.raises(EyrieError, match="demo.hidden_size / demo.num_attention_heads = 3 must"):
        DemoTargetSettings.from_settings({"demo": {"hidden_size": 12, "num_attention_heads": 4}})


def test_the_vocab_section_is_the_schemas():
    assert VocabSettings.from_settings({"vocab": {}}).draft_vocab_size == 1024  # its default
    with pytest.raises(EyrieError, match="vocab.draft_vocab_size: 1 is less than the minimum of 2"):
        VocabSettings.from_settings({"vocab": {"draft_vocab_size": 1}})
    with pytest.raises(EyrieError, match="vocab: missing; pass the config's vocab section"):
        VocabSettings.from_settings({})

"""Settings take one way in: the cross-field rules run once (the dry run and every stage say the
same words), reserved template keywords are the schema's."""

from __future__ import annotations

import pytest

from eyrie.chat.keywords import RESERVED_KWARGS
from eyrie.config.schema import cross_field_problems, key_schema, load_settings, validate_config
from eyrie.config.sections import TrainSettings
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

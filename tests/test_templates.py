"""Golden loss masks for the chat-template families users have (tests/templates/*.jinja).

Each family's template reproduces that family's behaviour: Llama-3 headers, a Qwen3-style thinking
template, DeepSeek-V3 markers, a Kimi-K2-style template with tool-call sections and a
gpt-oss-harmony-style template with analysis/final channels. For a multi-turn, a reasoning and a
tool-call conversation, tests/templates/golden.json pins the mask mode `auto` picks, the samples
and, per sample, the text that carries loss (the tokenizer has one token per character).
"""

from __future__ import annotations

import json

import pytest
from template_cases import CASES, FAMILIES, TEMPLATES, family_tokenizer, trained_text

from eyrie.data.records import to_conversation
from eyrie.data.turns import MaskSettings, masked_samples, template_traits

GOLDEN = json.loads((TEMPLATES / "golden.json").read_text())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_golden_masks(family):
    tok = family_tokenizer(family)
    golden = GOLDEN[family]
    assert template_traits(tok).as_dict() == golden["traits"]
    for name, want in golden["cases"].items():
        case, reasoning = name.split("/")
        settings = MaskSettings("auto", reasoning == "reasoning_trained")
        got = masked_samples(tok, to_conversation(CASES[case]), settings)
        assert got.mode == want["mode"], name
        assert got.reasoning_not_rendered == want["reasoning_not_rendered"], name
        assert [trained_text(tok, i, m) for i, m in got.samples] == want["trained"], name


def test_golden_covers_every_family_and_case():
    assert sorted(GOLDEN) == sorted(FAMILIES)
    for family in GOLDEN.values():
        assert sorted(family["cases"]) == sorted(
            f"{c}/{r}" for c in CASES for r in ("reasoning_trained", "reasoning_not_trained")
        )

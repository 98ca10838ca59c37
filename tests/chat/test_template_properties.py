"""Properties of the turn rule that hold for every published chat template vendored in
tests/templates/published (llama.cpp's collection, each with its source and commit), under each
switch the template reads, on every conversation of template_cases.CASES (multi-turn, system
prompts, reasoning, string and object tool-call arguments, parallel calls, an agent loop,
content parts, the peers' own test conversations):

- the trained text never holds a system, user or tool message's text;
- every trained turn ends with a token generation stops on;
- every sample's context before each trained turn is, token for token, the prompt a server
  renders for that turn (the oracle: the tokenizer's own apply_chat_template, given the
  messages as a server hands them);
- no turn is trained twice, and every assistant turn is trained or dropped with a counted reason.

A new template dropped into the folder (with its entry in templates.json) is checked here before
anyone writes its review.
"""

from __future__ import annotations

from collections import Counter

import pytest

from eyrie.chat.encoding import encode
from eyrie.chat.records import RecordError, content_text, to_conversation
from eyrie.chat.samples import conversation_samples
from eyrie.chat.template import ChatTemplate
from eyrie.chat.turn import TURN_DROPS
from tests.support.template_cases import CASES, PUBLISHED, standin_tokenizer
from tests.support.template_oracle import server_messages, server_prompt

# the template configurations that train no turn of any case, read off each file by hand: the
# reasons the records or turns are dropped for, and why
UNTRAINABLE = {
    "apriel_1_6_thinker@default": (
        {"not_derivable"},
        "llama.cpp's 'fixed' copy: the generation prompt opens reasoning with prose ('Here are my "
        "reasoning steps:'), no marker a reasoning parser splits on",
    ),
    "command_r_plus@default": (
        {"template_error"},
        "the tool_use template needs a description per parameter and its own tool-result shape",
    ),
    "firefunction_v2@default": (
        {"template_error"},
        "the template reads a `functions` variable no server passes",
    ),
    "mirothinker_v1@default": (
        {"template_error"},
        "llama.cpp's patched copy assigns attributes on messages, which sandboxed jinja refuses",
    ),
    "deepseek_v3_2_llamacpp@default": (
        {"not_derivable", "reasoning_missing"},
        "llama.cpp's own template: its render without a generation prompt already writes the "
        "assistant header, and its generation prompt a second user and assistant header",
    ),
}
UNTRAINABLE["mirothinker_v1@thinking_off"] = UNTRAINABLE["mirothinker_v1@default"]
UNTRAINABLE["deepseek_v3_2_llamacpp@thinking_off"] = UNTRAINABLE["deepseek_v3_2_llamacpp@default"]

CONFIGS = [(name, config) for name, spec in sorted(PUBLISHED.items()) for config in spec.configs]
MIN_TEXT = 8  # shorter message texts may recur inside an answer by chance


def template(name: str, config: str) -> ChatTemplate:
    spec = PUBLISHED[name]
    tok = standin_tokenizer(name)
    eos = [tok.convert_tokens_to_ids(t) for t in spec.stops] or None
    return ChatTemplate.of(tok, spec.configs[config], eos)


def others(conv) -> list[str]:
    """The texts of the record's system, user and tool messages that no assistant message
    holds."""
    mine = [content_text(m["content"]) for m in conv.messages if m["role"] == "assistant"]
    texts = []
    for m in conv.messages:
        if m["role"] == "assistant":
            continue
        parts = m["content"] if isinstance(m["content"], list) else [{"text": m["content"]}]
        texts += [p["text"] for p in parts]
    return [t for t in texts if len(t) >= MIN_TEXT and not any(t in a for a in mine)]


def check_record(tpl: ChatTemplate, case: str) -> Counter:
    """Assert every property on CASES[case]; the turns trained and the reasons of those not."""
    conv = to_conversation(CASES[case])
    first = conv.first_turn()
    assistant = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant" and i >= first]
    try:
        samples, encoded, _, counts = conversation_samples(tpl, conv, "auto")
    except RecordError as err:
        assert err.reason in ("template_error", "template_rule"), err
        kind = err.reason if err.reason == "template_error" else err.detail.split(":")[0]
        return Counter({kind: len(assistant)})
    trained = [turn for sample in samples for turn in sample.turns]
    assert len(trained) == len(set(trained)), "a turn trained twice"
    dropped = counts["dropped"]
    assert set(dropped) <= set(TURN_DROPS)
    assert len(trained) + sum(dropped.values()) == len(assistant), "every turn counted"
    stops = {*tpl.stops, tpl.tokenizer.eos_token}
    messages = server_messages(conv.messages, tpl.tool_arguments, tpl.content, tpl.reasoning)
    for sample, (ids, mask) in zip(samples, encoded):
        at = 0
        turns = iter(sample.turns)
        for text, is_trained, _ in sample.pieces:
            piece = encode(tpl.tokenizer, text)
            if is_trained:
                turn = next(turns)
                assert any(text.endswith(s) for s in stops if s), (turn, text[-40:])
                for other in others(conv):
                    assert other not in text, (turn, other)
                prompt = server_prompt(tpl.tokenizer, messages[:turn], conv.tools, tpl.kwargs)
                assert ids[:at] == encode(tpl.tokenizer, prompt), f"context of turn {turn}"
                assert mask[at : at + len(piece)] == [1] * len(piece)
            else:
                assert not any(mask[at : at + len(piece)])
            at += len(piece)
        assert at == len(ids)
    return Counter({"trained": len(trained), **dropped})


@pytest.mark.parametrize("name, config", CONFIGS, ids=[f"{n}@{c}" for n, c in CONFIGS])
def test_every_published_template_trains_only_what_the_model_generates(name, config):
    tpl = template(name, config)
    totals = sum((check_record(tpl, case) for case in CASES), Counter())
    if f"{name}@{config}" in UNTRAINABLE:
        kinds, _ = UNTRAINABLE[f"{name}@{config}"]
        assert set(totals) <= kinds and "trained" not in totals, totals
    else:
        assert totals["trained"] > 0, totals

"""The turn rule on published chat templates (tests/templates/published, each with its source and
commit), against what a person read off each template (tests/templates/reviewed) and against
the prompts a server renders.

tests/templates/reviewed/<name>.json holds, for the conversations multi_turn, agent_reasoning and
tool_call_string of template_cases.CASES, each assistant turn's text as the model generates it,
or why it cannot be trained: written from the template and the model card, never printed by
eyrie's code (tests/templates/reviewed/README.md). The context of every trained turn is checked
against oracles that are not eyrie's code: the tokenizer's own `apply_chat_template` with the
generation prompt, given the messages as a server passes them, and vLLM's own renderer.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eyrie.chat.encoding import encode
from eyrie.chat.forms import REASONING_MARKERS
from eyrie.chat.records import RecordError, to_conversation
from eyrie.chat.samples import MaskSettings, conversation_samples, masked_samples
from eyrie.chat.template import ChatTemplate
from eyrie.chat.turn import TurnDropped, turn_of
from eyrie.config.schema import key_schema
from tests.support import TESTS
from tests.support.models import config_only_llama
from tests.support.template_cases import (
    ARGUMENTS,
    CASES,
    PUBLISHED,
    TEMPLATES,
    standin_target,
    standin_tokenizer,
    trained_text,
)
from tests.support.template_oracle import server_messages, server_prompt

REVIEWED = sorted((TEMPLATES.parent / "reviewed").glob("*.json"))


def template(name: str, kwargs: dict | None = None) -> ChatTemplate:
    spec = PUBLISHED[name]
    tok = standin_tokenizer(name)
    eos = [tok.convert_tokens_to_ids(t) for t in spec.stops] or None
    return ChatTemplate.of(tok, kwargs if kwargs is not None else spec.kwargs, eos)


def outcome(tpl: ChatTemplate, case: str) -> dict:
    """What auto mode trains of CASES[case]: mode, turn counts, trained text per sample."""
    try:
        got = masked_samples(tpl, to_conversation(CASES[case]), MaskSettings())
    except RecordError as err:
        return {"dropped": err.reason, "detail": err.detail}
    return {
        "mode": got.mode,
        "turns": got.counts,
        "trained": [trained_text(tpl.tokenizer, ids, mask) for ids, mask in got.samples],
    }


@pytest.mark.parametrize("path", REVIEWED, ids=[p.stem for p in REVIEWED])
def test_every_turn_is_what_the_review_says_the_model_generates(path):
    review = json.loads(path.read_text())
    tpl = template(review["template"], review["config"])
    assert set(review["stops"]) <= {*tpl.stops, tpl.tokenizer.eos_token}, "stops as reviewed"
    for case, turns in review["cases"].items():
        conv = to_conversation(CASES[case])
        for index, want in turns.items():
            try:
                got = {"trained": turn_of(tpl, conv, int(index)).text}
            except TurnDropped as drop:
                got = {"dropped": drop.reason}
            assert got == {k: v for k, v in want.items() if k != "why"}, (case, index)


def test_the_reviews_cover_twelve_families_three_conversations_each():
    families = {json.loads(p.read_text())["template"] for p in REVIEWED}
    assert len(families) >= 12 and families <= set(PUBLISHED)
    for path in REVIEWED:
        review = json.loads(path.read_text())
        assert sorted(review["cases"]) == ["agent_reasoning", "multi_turn", "tool_call_string"]
        for case, turns in review["cases"].items():
            messages = CASES[case]["messages"]
            assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i]
            assert sorted(map(int, turns)) == assistant, (path.name, case)


@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_the_argument_form_is_read_off_the_template(name):
    assert template(name).tool_arguments == ARGUMENTS[name]  # as read off the file by hand


def checked_contexts(tpl: ChatTemplate, record: dict) -> int:
    """Assert that the context of every trained turn of `record` is, token for token, the
    oracle's prompt for it; the number of turns checked (0 when the record is dropped)."""
    conv = to_conversation(record)
    try:
        samples, encoded, _, _ = conversation_samples(tpl, conv, "auto")
    except RecordError:
        return 0
    messages = server_messages(conv.messages, tpl.tool_arguments, tpl.content, tpl.reasoning)
    checked = 0
    for sample, (ids, _) in zip(samples, encoded):
        for (start, _), turn in zip(sample.spans, sample.turns):
            oracle = server_prompt(tpl.tokenizer, messages[:turn], conv.tools, tpl.kwargs)
            assert sample.text[:start] == oracle, turn
            assert ids[: len(encode(tpl.tokenizer, oracle))] == encode(tpl.tokenizer, oracle)
            checked += 1
    return checked


@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_every_context_is_the_prompt_a_server_renders(name):
    tpl = template(name)
    assert sum(checked_contexts(tpl, record) for record in CASES.values()) >= 10


def test_kimi_thinking_trains_the_reasoning_of_a_final_answer():
    """Kimi-K2-Thinking renders every message up to the last answer as history (<think></think>):
    the answer's own reasoning comes from its in-progress rendering."""
    tpl = template("kimi_k2_thinking")
    got = outcome(tpl, "reasoning")
    first, second = got["trained"]
    assert first == ["<think>Standard greeting.</think>Guten Morgen.<|im_end|>"]
    assert second == ["<think>Three plus three.</think>6.<|im_end|>"]
    assert (
        got["turns"]["reasoning_in_progress"] == 2 and got["turns"]["reasoning_not_rendered"] == 0
    )


def test_string_arguments_are_parsed_as_a_server_parses_them():
    for name in ("llama3_1", "gpt_oss", "kimi_k2_instruct", "qwen3_coder", "glm_4_6"):
        tpl = template(name)
        assert outcome(tpl, "tool_call_string") == outcome(tpl, "tool_call_object"), name
    deepseek = outcome(template("deepseek_v3_1"), "tool_call_object")
    assert '<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>' in deepseek["trained"][0][0]


def test_glm_turns_end_with_the_token_the_model_stops_on():
    got = outcome(template("glm_4_6"), "tool_call_string")
    runs = [run for sample in got["trained"] for run in sample]
    assert runs[0].endswith("</tool_call><|observation|>") and runs[-1].endswith("<|user|>")
    assert got["turns"]["without_stop_token"] == 0


def test_a_template_that_drops_parallel_calls_drops_that_turn():
    """gpt-oss renders only the first of parallel calls: that turn is not trained (counted); the
    answer after it is, in the context the template renders."""
    tpl = template("gpt_oss")
    got = outcome(tpl, "parallel_calls")
    assert got["turns"]["dropped"] == {"tool_calls_not_rendered": 1}
    assert got["trained"] == [
        ["<|channel|>final<|message|>Oslo -3 C; Bergen 4 C and rain.<|return|>"]
    ]
    with pytest.raises(TurnDropped, match="renders 1 of the 2 tool calls"):
        turn_of(tpl, to_conversation(CASES["parallel_calls"]), 1)


# vLLM serves gpt-oss through openai_harmony, not through its chat template
VLLM_SERVED = [name for name in PUBLISHED if name != "gpt_oss"]


def request(record: dict) -> list[dict]:
    """The record's messages as an OpenAI chat request carries them (reasoning as `reasoning`,
    the request field vLLM reads)."""
    out = []
    for message in record["messages"]:
        message = dict(message)
        if "reasoning_content" in message:
            message["reasoning"] = message.pop("reasoning_content")
        out.append(message)
    return out


@pytest.mark.slow
def test_every_context_is_the_prompt_vllm_renders(tmp_path):
    """The contexts again, against vLLM's own renderer (parse_chat_messages with its
    content-format detection and argument parsing, then safe_apply_chat_template) in the vLLM
    environment, for every vendored template vLLM serves through its template: eyrie hands
    content as vLLM does (as parts to a template that loops over them, by vLLM's detection; a
    tool result as text), so every context it renders is vLLM's but where it passes tool-call
    arguments as JSON text to a template that cannot take objects, or reasoning as "thinking"
    parts to a template that renders reasoning only from those (Ministral-3 Reasoning)."""
    from tests.support.vllm_helpers import VLLM_ENVS, vllm_env

    python = vllm_env(next(iter(VLLM_ENVS)))
    jobs, contexts = [], []
    for name in VLLM_SERVED:
        folder = config_only_llama(standin_target(tmp_path / name, name), 512)
        tpl = ChatTemplate.load(folder)
        for case, record in CASES.items():
            try:
                samples, _, _, _ = conversation_samples(tpl, to_conversation(record), "auto")
            except RecordError:
                continue
            for sample in samples:
                for (start, _), turn in zip(sample.spans, sample.turns):
                    messages = request(record)[:turn]
                    tools = record.get("tools")
                    jobs.append({"target": str(folder), "messages": messages, "tools": tools})
                    jobs[-1]["kwargs"] = PUBLISHED[name].kwargs
                    contexts.append((name, case, turn, sample.text[:start]))
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    script = TESTS / "support" / "vllm_render.py"
    args = [str(python), str(script), str(tmp_path / "jobs.json"), str(tmp_path / "out.json")]
    subprocess.run(args, check=True, capture_output=True, timeout=600)
    loaded = {name: ChatTemplate.load(tmp_path / name) for name in VLLM_SERVED}
    # where eyrie departs from vLLM on purpose: tool-call arguments as JSON text to a template that
    # cannot take objects, reasoning as "thinking" parts to a template that renders only those
    departs = {
        n for n, t in loaded.items() if t.tool_arguments == "string" or t.reasoning == "chunks"
    }
    refused, other, equal = set(), set(), 0
    for (name, case, turn, context), got in zip(
        contexts, json.loads((tmp_path / "out.json").read_text())
    ):
        if "error" in got:
            refused.add((name, case, got["error"][:80]))
        elif got["prompt"] != context:
            other.add((name, case, turn))
        else:
            equal += 1
    # vLLM parses arguments into objects, which some templates concatenate as text (vLLM cannot
    # render their tool-call history) or print as a Python dict; it hands reasoning on as a field
    assert {name for name, *_ in refused | other} <= departs, sorted(refused | other)
    print(f"vLLM oracle: {equal} contexts equal, {len(refused)} refused, {len(other)} other")
    assert equal >= 1000


KIMI_K25 = TESTS / "remote_code" / "kimi_k25"


@pytest.fixture(scope="module")
def kimi_k25(tmp_path_factory):
    """Kimi-K2.5's remote-code tokenizer (vendored) over a stand-in vocabulary, with its
    generation_config.json's eos (<|im_end|>, 163586 published)."""
    sys.path.insert(0, str(KIMI_K25))
    try:
        import standin_vocab
    finally:
        sys.path.remove(str(KIMI_K25))
    folder = standin_vocab.standin_folder(tmp_path_factory.mktemp("kimi_k25"))
    eos = standin_vocab.standin_id(163586)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


def test_remote_code_renders_through_the_tokenizers_own_apply_chat_template(kimi_k25):
    """Kimi-K2.5's tokenizer code declares tools TypeScript-style (tools_ts_str) and opens
    <think> in the generation prompt; its `thinking` switch comes from chat_template_kwargs."""
    tpl = ChatTemplate.load(kimi_k25, trust_remote_code=True)
    record = CASES["agent_reasoning"]
    assert checked_contexts(tpl, record) == 3
    got = outcome(tpl, "agent_reasoning")
    assert got["trained"] == [
        [
            "Ask the tool.</think><|tool_calls_section_begin|><|tool_call_begin|>"
            'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo", "days": 2}'
            "<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
            "Report both days.</think>Cold: -3 C, then -5 C.<|im_end|>",
        ],
        ["Be polite.</think>You're welcome.<|im_end|>"],
    ]
    samples, _, _, _ = conversation_samples(tpl, to_conversation(record), "auto")
    assert "type get_weather = (_: {" in samples[0].text and '"parameters"' not in samples[0].text
    off = ChatTemplate.load(kimi_k25, trust_remote_code=True, kwargs={"thinking": False})
    assert checked_contexts(off, record) == 3
    quiet = outcome(off, "agent_reasoning")
    assert quiet["turns"]["reasoning_not_rendered"] == 3
    assert quiet["trained"][-1][-1] == "You're welcome.<|im_end|>"


def test_the_schema_accepts_the_reasoning_parsers_whose_markers_are_known():
    assert key_schema("data.reasoning_parser")["enum"] == [None, *REASONING_MARKERS]


# a stand-in template (written here) whose generation prompt opens a reasoning block with markers
# its source never spells (they come from a variable), and that cuts reasoning from every turn
STANDIN_OPENS_UNSPELT = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}"
    "{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ think_open }}{% endif %}"
)


def test_a_reasoning_parser_names_the_markers_a_template_does_not_spell():
    tok = standin_tokenizer("qwen3")
    tok.chat_template = STANDIN_OPENS_UNSPELT
    kwargs = {"think_open": "<seed:think>"}
    record = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4.", "reasoning_content": "Add them."},
        ]
    }
    conv = to_conversation(record)
    with pytest.raises(TurnDropped, match="does not follow the generation prompt"):
        turn_of(ChatTemplate.of(tok, kwargs), conv, 1)
    tpl = ChatTemplate.of(tok, kwargs, reasoning_parser="seed_oss")
    turn = turn_of(tpl, conv, 1)
    assert (turn.text, turn.path) == ("Add them.</seed:think>4.<|im_end|>", "parser")

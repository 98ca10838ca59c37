"""Golden loss masks for the chat templates the model publishers ship (tests/templates/published).

For every published template and every conversation of template_cases.CASES (multi-turn,
reasoning, string and object tool-call arguments, parallel calls, an agent loop, the peers' own
test conversations), tests/templates/golden.json pins what `data.mask_mode: auto` trains: the
mode, the turn counts and, per sample, the text that carries loss (the stand-in tokenizer has one
token per byte), or the reason the record is dropped. The context of every trained turn is checked
against an oracle that is not eyrie's code: the tokenizer's own `apply_chat_template` with the
generation prompt, given the messages as a server passes them (tool-call arguments parsed from
JSON, as vLLM's chat utilities do, or as JSON text for a template that takes text).

`python tests/data/test_templates.py --write` rewrites golden.json (review the diff: it is the
spec).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from eyrie.chat.records import RecordError, to_conversation
from eyrie.chat.samples import MaskSettings, conversation_samples, masked_samples, template_traits
from eyrie.chat.template import ChatTemplate
from tests.support import TESTS
from tests.support.models import config_only_llama
from tests.support.template_cases import (
    CASES,
    PUBLISHED,
    TEMPLATES,
    standin_target,
    standin_tokenizer,
    trained_text,
)

GOLDEN_PATH = TEMPLATES.parent / "golden.json"


def template(name: str) -> ChatTemplate:
    spec = PUBLISHED[name]
    tok = standin_tokenizer(name)
    eos = [tok.convert_tokens_to_ids(t) for t in spec.stops] or None
    return ChatTemplate.of(tok, spec.kwargs, eos)


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


def golden() -> dict:
    out = {}
    for name in PUBLISHED:
        tpl = template(name)
        out[name] = {
            "traits": template_traits(tpl).as_dict(),
            "cases": {case: outcome(tpl, case) for case in CASES},
        }
    return out


GOLDEN = json.loads(GOLDEN_PATH.read_text()) if GOLDEN_PATH.exists() else {}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_golden_masks(name):
    tpl = template(name)
    assert template_traits(tpl).as_dict() == GOLDEN[name]["traits"]
    assert tpl.tool_arguments == PUBLISHED[name].arguments  # as read off the file by hand
    for case in CASES:
        assert outcome(tpl, case) == GOLDEN[name]["cases"][case], case


def test_golden_covers_every_template_and_case():
    assert sorted(GOLDEN) == sorted(PUBLISHED)
    for entry in GOLDEN.values():
        assert sorted(entry["cases"]) == sorted(CASES)


def server_messages(messages: list[dict], form: str) -> list[dict]:
    """Messages as a server hands them to the template: arguments parsed from JSON text (vLLM's
    _postprocess_messages; empty: {}), or JSON text for a template that takes text; the
    reasoning under the names templates read it by."""
    out = []
    for message in messages:
        message = dict(message)
        calls = []
        for call in message.get("tool_calls") or []:
            args = call["function"].get("arguments")
            if form == "object" and not isinstance(args, dict):
                args = json.loads(args) if args else {}
            elif form == "string" and not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            calls.append({**call, "function": {**call["function"], "arguments": args}})
        if calls:
            message["tool_calls"] = calls
        if "reasoning_content" in message:
            message["reasoning"] = message["thinking"] = message["reasoning_content"]
        out.append(message)
    return out


DATE = re.compile(r"\d{4}-\d{2}-\d{2}")  # gpt-oss writes today's date into its system message


def checked_contexts(tpl: ChatTemplate, record: dict, form: str) -> int:
    """Assert that the context of every trained turn of `record` is the oracle's prompt for it;
    the number of turns checked (0 when the record is dropped: test_golden_masks pins why)."""
    conv = to_conversation(record)
    try:
        samples, _, _ = conversation_samples(tpl, conv, "auto")
    except RecordError:
        return 0
    messages, checked = server_messages(conv.messages, form), 0
    for sample in samples:
        for (start, _), turn in zip(sample.spans, sample.turns):
            oracle = tpl.tokenizer.apply_chat_template(
                messages[:turn],
                tools=conv.tools,
                add_generation_prompt=True,
                tokenize=False,
                **tpl.kwargs,
            )
            assert DATE.sub("D", sample.text[:start]) == DATE.sub("D", oracle), turn
            checked += 1
    return checked


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_context_is_the_prompt_a_server_renders(name):
    tpl, form = template(name), PUBLISHED[name].arguments
    assert sum(checked_contexts(tpl, record, form) for record in CASES.values()) >= 10


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


def test_a_template_that_drops_parallel_calls_drops_the_record():
    got = outcome(template("gpt_oss"), "parallel_calls")
    assert got["dropped"] == "template_rule"
    assert got["detail"].startswith("tool_calls_not_rendered: the template renders 1 of the 2")


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


def test_every_context_is_the_prompt_vllm_renders(tmp_path):
    """The contexts again, against vLLM's own renderer (parse_chat_messages with its
    content-format detection and argument parsing, then safe_apply_chat_template) in the vLLM
    environment."""
    from tests.support.vllm_helpers import VLLM_ENVS, vllm_env

    python = vllm_env(next(iter(VLLM_ENVS)))
    jobs, contexts = [], []
    for name in VLLM_SERVED:
        folder = config_only_llama(standin_target(tmp_path / name, name), 512)
        tpl = ChatTemplate.load(folder)
        for case, record in CASES.items():
            try:
                samples, _, _ = conversation_samples(tpl, to_conversation(record), "auto")
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
    refused, quirks, equal = set(), 0, 0
    for (name, case, turn, context), got in zip(
        contexts, json.loads((tmp_path / "out.json").read_text())
    ):
        if "error" in got:
            refused.add((name, case))
            continue
        if got["prompt"] != context:
            # vLLM's content-format detection gives Kimi-K2-Instruct's template content parts,
            # and its tool-call branch prints them as a Python list: no model emits that; eyrie
            # passes the text the template's `content is string` branch takes
            assert (
                name == "kimi_k2_instruct"
                and "<|im_middle|>[{'type': 'text', 'text': " in (got["prompt"])
            ), (name, case, turn)
            quirks += 1
        else:
            equal += 1
    # vLLM parses arguments into objects, which DeepSeek-V3.1's template concatenates as text:
    # vLLM cannot render its tool-call history at all; eyrie passes it text
    assert {name for name, _ in refused} == {"deepseek_v3_1"}
    assert {case for _, case in refused} == {
        "tool_call_string",
        "tool_call_object",
        "parallel_calls",
        "agent_reasoning",
        "specforge_tool_use",
        "speculators_tool_call",
    }
    print(f"vLLM oracle: {equal} contexts equal, {quirks} quirks, {len(refused)} refused")
    assert equal >= 100 and quirks == 6


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
    assert checked_contexts(tpl, record, "object") == 3
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
    samples, _, _ = conversation_samples(tpl, to_conversation(record), "auto")
    assert "type get_weather = (_: {" in samples[0].text and '"parameters"' not in samples[0].text
    off = ChatTemplate.load(kimi_k25, trust_remote_code=True, kwargs={"thinking": False})
    assert checked_contexts(off, record, "object") == 3
    quiet = outcome(off, "agent_reasoning")
    assert quiet["turns"]["reasoning_not_rendered"] == 3
    assert quiet["trained"][-1][-1] == "You're welcome.<|im_end|>"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN_PATH.write_text(json.dumps(golden(), indent=1, ensure_ascii=False) + "\n")

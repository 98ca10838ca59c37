"""The published chat templates of tests/templates/published and the conversations their golden
masks pin (test_templates.py).

The templates are the publishers' files (README.md there names each one's source and commit).
The vocabulary is a stand-in: `standin_tokenizer` makes every byte its own token and each
template's markers special tokens, so that the trained text is exactly the characters the loss
mask covers; `standin_target` writes it to a folder with a generation_config.json whose
eos_token_id list names the same tokens as the model's published one (stand-in ids, the
published tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# tests/templates (this module also runs outside pytest: scripts/template_turns.py)
TEMPLATES = Path(__file__).resolve().parents[1] / "templates" / "published"

MANIFEST = TEMPLATES / "templates.json"


@dataclass(frozen=True)
class Published:
    """A published template, the special tokens of its model's tokenizer (bos, eos, the rest),
    the tokens of its generation_config.json's eos_token_id, and its switches to test."""

    file: str
    bos: str | None
    eos: str
    specials: list[str]
    stops: list[str]  # generation_config.json's eos_token_id, as tokens
    configs: dict = field(default_factory=lambda: {"default": {}})
    model: str = ""
    kwargs: dict = field(default_factory=dict)


def _published() -> dict[str, Published]:
    """The vendored templates, from tests/templates/published/templates.json."""
    out = {}
    for name, entry in json.loads(MANIFEST.read_text()).items():
        out[name] = Published(
            entry["file"],
            entry.get("bos"),
            entry["eos"],
            list(entry.get("specials") or []),
            list(entry.get("stops") or []),
            dict(entry.get("configs") or {"default": {}}),
            entry.get("model", ""),
        )
    return out


PUBLISHED = _published()

# how the template takes tool-call arguments, read off the file by hand
ARGUMENTS = {
    "kimi_k2_instruct": "object",
    "kimi_k2_thinking": "object",
    "qwen3": "object",
    "qwen3_coder": "object",
    "deepseek_v3_1": "string",
    "gpt_oss": "object",
    "llama3_1": "object",
    "glm_4_6": "object",
}


def standin_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """A byte-per-token tokenizer (a stand-in vocabulary) with `name`'s published template and
    its model's special tokens."""
    spec = PUBLISHED[name]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 20)
    specials = list(dict.fromkeys([t for t in (spec.bos, spec.eos) if t] + spec.specials))
    fast.add_special_tokens({"additional_special_tokens": specials})
    fast.bos_token, fast.eos_token = spec.bos, spec.eos
    fast.chat_template = (TEMPLATES / spec.file).read_bytes().decode()
    return fast


def standin_target(folder: Path, name: str) -> Path:
    """A target folder with `name`'s stand-in tokenizer and a generation_config.json naming the
    published eos tokens (by the stand-in's ids)."""
    tok = standin_tokenizer(name)
    tok.save_pretrained(folder)
    ids = [tok.convert_tokens_to_ids(t) for t in PUBLISHED[name].stops]
    if ids:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return folder


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def _call(arguments, name="get_weather", k=0) -> dict:
    return {
        "id": f"functions.{name}:{k}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _result(content: str, k=0, name="get_weather") -> dict:
    return {
        "role": "tool",
        "tool_call_id": f"functions.{name}:{k}",
        "name": name,
        "content": content,
    }


def _tool_call(arguments) -> dict:
    return {
        "tools": [WEATHER],
        "messages": [
            {"role": "system", "content": "You are a weather bot."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Ask the tool.",
                "tool_calls": [_call(arguments)],
            },
            _result("-3 C, snow"),
            {"role": "assistant", "content": "-3 C and snowing."},
        ],
    }


# Conversations as serving logs and datasets have them (OpenAI shape), and the peers' own.
CASES = {
    "multi_turn": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4."},
        ]
    },
    "reasoning": {
        "messages": [
            {"role": "user", "content": "Guten Morgen?"},
            {
                "role": "assistant",
                "content": "Guten Morgen.",
                "reasoning_content": "Standard greeting.",
            },
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6.", "reasoning_content": "Three plus three."},
        ]
    },
    # the OpenAI API's shape: arguments as a JSON string
    "tool_call_string": _tool_call('{"city": "Oslo"}'),
    "tool_call_object": _tool_call({"city": "Oslo"}),
    "parallel_calls": {
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Oslo and Bergen?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [_call('{"city": "Oslo"}'), _call('{"city": "Bergen"}', k=1)],
            },
            _result("-3 C"),
            _result("4 C, rain", k=1),
            {"role": "assistant", "content": "Oslo -3 C; Bergen 4 C and rain."},
        ],
    },
    # an agent loop: reasoning on every turn, a call, its result, the answer, a new question
    "agent_reasoning": {
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Oslo for 2 days?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Ask the tool.",
                "tool_calls": [_call('{"city": "Oslo", "days": 2}')],
            },
            _result("-3 C, then -5 C"),
            {
                "role": "assistant",
                "content": "Cold: -3 C, then -5 C.",
                "reasoning_content": "Report both days.",
            },
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "You're welcome.", "reasoning_content": "Be polite."},
        ],
    },
    # content as parts, as OpenAI-form datasets give them (a server joins them for a template that
    # takes text, or passes the list to one that loops over it)
    "content_parts": {
        "messages": [
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": "You are a geography tutor."},
                    {"type": "text", "text": "Answer in one sentence."},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is the capital of Norway?"},
                    {"type": "text", "text": "And how many people live there?"},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "Oslo, home to 700,000."}]},
            {"role": "user", "content": "And of Sweden?"},
            {
                "role": "assistant",
                "content": "Stockholm, home to about a million.",
                "reasoning_content": "Sweden's capital is Stockholm.",
            },
        ]
    },
    # SpecForge tests/test_data/test_parsers.py @ 916d14e2686f5d280ab67dc232de5acdb701d41c:
    # tool_use_messages (object arguments, no call ids, tool results without tool_call_id)
    "specforge_tool_use": {
        "messages": [
            {"role": "user", "content": "我想知道今天北京和上海的天气怎么样？"},
            {
                "role": "assistant",
                "content": "我来帮您查询北京和上海的天气情况。",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"location": "北京", "date": "today"},
                        },
                    },
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"location": "上海", "date": "today"},
                        },
                    },
                ],
            },
            {
                "role": "tool",
                "content": '{"location": "北京", "temperature": 25, "condition": "晴朗", '
                '"humidity": "45%"}',
            },
            {
                "role": "tool",
                "content": '{"location": "上海", "temperature": 28, "condition": "多云", '
                '"humidity": "65%"}',
            },
            {
                "role": "assistant",
                "content": "根据查询结果，北京今天晴朗，25°C；上海多云，28°C。两地都比较适合出行。",
            },
        ]
    },
    # the same file: reasoning_multi_turn_messages
    "specforge_reasoning_multi_turn": {
        "messages": [
            {"role": "user", "content": "Can you recommend a good restaurant in Shanghai?"},
            {
                "role": "assistant",
                "content": "Sure! I think I can help with that.",
                "reasoning_content": "If a user is looking for a restaurant in Shanghai, they "
                "can go to the Peace Hotel.",
            },
            {"role": "user", "content": "Where is the Peace Hotel?"},
            {
                "role": "assistant",
                "content": "The Peace Hotel is located at the intersection of Nanjing East Road "
                "and the Bund.",
                "reasoning_content": "Let me think. The Peace Hotel is located at the "
                "intersection of Nanjing East Road and the Bund.",
            },
        ]
    },
    # speculators tests/integration/datagen/test_preprocessing.py
    # @ 02bd9d7326d358429d37d457b2feeaf1be8c13dc: the tool-call normalization conversation
    # (string arguments, content None)
    "speculators_tool_call": {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_123",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "content": '{"temperature": 20}', "tool_call_id": "call_123"},
            {"role": "assistant", "content": "The weather in Paris is 20°C."},
        ]
    },
    # speculators tests/e2e/smoke/test_render_boundary.py
    # @ 0936379e5f9cc760731f971d874d5c2548960466: an assistant turn first, a user turn last
    "speculators_render_boundary": {
        "messages": [
            {"role": "assistant", "content": "Here is the first batch of data."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "It is 4."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "It is 6."},
            {"role": "user", "content": "thanks"},
        ]
    },
}


def trained_text(tok, ids: list[int], mask: list[int]) -> list[str]:
    """The runs of consecutive tokens with loss, decoded."""
    runs, run = [], []
    for token, bit in zip(ids, mask):
        if bit:
            run.append(token)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs + ([tok.decode(run)] if run else [])


# the names the data-input tests use
FAMILY = {"llama3": "llama3_1", "qwen3": "qwen3"}


def family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    return standin_tokenizer(FAMILY[family])

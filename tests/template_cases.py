"""The template families of tests/templates and the conversations their golden masks pin.

A tokenizer of single characters (every byte its own token, each family's markers special) makes
the trained text exactly the characters the loss mask covers.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

TEMPLATES = Path(__file__).resolve().parent / "templates"

# family -> (bos, eos, markers the template writes)
FAMILIES = {
    "llama3": (
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>"],
    ),
    "qwen3": (None, "<|im_end|>", ["<|im_start|>"]),
    "deepseek_v3": (
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        ["<｜User｜>", "<｜Assistant｜>"]
        + [f"<｜tool▁{w}｜>" for w in ("calls▁begin", "calls▁end", "call▁begin", "call▁end")]
        + [f"<｜tool▁{w}｜>" for w in ("sep", "outputs▁begin", "outputs▁end")]
        + ["<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"],
    ),
    "kimi_k2": (
        None,
        "<|im_end|>",
        ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"]
        + ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"]
        + ["<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"],
    ),
    "gpt_oss": (
        None,
        "<|return|>",
        ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|call|>"],
    ),
}


def family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A byte-per-token tokenizer with `family`'s chat template and markers."""
    bos, eos, markers = FAMILIES[family]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 20)
    specials = [t for t in (bos, eos) if t] + markers
    fast.add_special_tokens({"additional_special_tokens": specials})
    fast.bos_token, fast.eos_token = bos, eos
    fast.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    return fast


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

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
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4.", "reasoning_content": "Add two and two."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6.", "reasoning_content": "Three plus three."},
        ]
    },
    "tool_call": {
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Ask the tool.",
                "tool_calls": [
                    {
                        "id": "functions.get_weather:0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "functions.get_weather:0",
                "name": "get_weather",
                "content": "-3 C, snow",
            },
            {"role": "assistant", "content": "-3 C and snowing."},
        ],
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

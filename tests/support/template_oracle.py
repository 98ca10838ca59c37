"""The oracle of the template tests: what a server renders as the prompt of a turn, computed with
the tokenizer's own `apply_chat_template` from the messages as a server hands them, written here
without eyrie's code (the forms it is given are read off the template: arguments as objects or
JSON text, content as a string or parts, reasoning as fields or "thinking" parts; vLLM's own
renderer checks those forms in test_templates.py)."""

from __future__ import annotations

import json


def server_messages(
    messages: list[dict], arguments: str, content: str = "string", reasoning: str = "field"
) -> list[dict]:
    """Messages as a server hands them to the template: arguments parsed from JSON text (vLLM's
    _postprocess_messages; empty: {}), or JSON text for a template that takes text; content as
    text (parts joined with "\\n") or as a list of text parts; the reasoning under the names
    templates read it by, or as a leading "thinking" part."""
    out = []
    for message in messages:
        message = dict(message)
        calls = []
        for call in message.get("tool_calls") or []:
            args = call["function"].get("arguments")
            if arguments == "object" and not isinstance(args, dict):
                args = json.loads(args) if args else {}
            elif arguments == "string" and not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            calls.append({**call, "function": {**call["function"], "arguments": args}})
        if calls:
            message["tool_calls"] = calls
        text = message.get("content")
        parts = text if isinstance(text, list) else [{"type": "text", "text": text}]
        parts = [] if text is None else parts
        thinking = message.get("reasoning_content")
        if reasoning == "chunks" and thinking is not None:
            del message["reasoning_content"]
            message["content"] = [{"type": "thinking", "thinking": thinking}, *parts]
        elif content == "openai" and message["role"] != "tool":  # a tool result stays text
            message["content"] = parts
        else:
            message["content"] = "\n".join(p["text"] for p in parts)
        if reasoning == "field" and thinking is not None:
            message["reasoning"] = message["thinking"] = thinking
        out.append(message)
    return out


def server_prompt(tokenizer, messages: list[dict], tools, kwargs: dict) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
    )

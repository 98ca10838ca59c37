"""The prompts vLLM's own chat renderer makes, for test_templates.py's oracle (run in a vLLM
environment: `<vllm python> tests/support/vllm_render.py JOBS.json OUT.json`).

Each job is a target folder, an OpenAI-shape request (`messages`, `tools`, `chat_template_kwargs`)
and the number of leading messages to render with the generation prompt; the request goes through
vLLM's parse_chat_messages (its content-format detection and the normalisation that parses
tool-call arguments) and safe_apply_chat_template, as the OpenAI server renders a chat request.
OUT.json holds, per job, the prompt text or the error vLLM gives.
"""

from __future__ import annotations

import json
import sys


def render(jobs: list[dict]) -> list[dict]:
    from vllm.config import ModelConfig
    from vllm.entrypoints.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template
    from vllm.tokenizers import get_tokenizer

    loaded, out = {}, []
    for job in jobs:
        folder = job["target"]
        if folder not in loaded:
            loaded[folder] = (ModelConfig(model=folder, tokenizer=folder), get_tokenizer(folder))
        model_config, tokenizer = loaded[folder]
        try:
            form = resolve_chat_template_content_format(
                None, job["tools"], "auto", tokenizer, model_config=model_config
            )
            conversation, _, _ = parse_chat_messages(job["messages"], model_config, form)
            prompt = safe_apply_chat_template(
                model_config,
                tokenizer,
                conversation,
                tools=job["tools"],
                tokenize=False,
                add_generation_prompt=True,
                **job["kwargs"],
            )
            out.append({"prompt": prompt})
        except Exception as exc:  # noqa: BLE001 - vLLM's refusal is the answer for that job
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    return out


if __name__ == "__main__":
    jobs_path, out_path = sys.argv[1:3]
    with open(jobs_path) as f:
        result = render(json.load(f))
    with open(out_path, "w") as f:
        json.dump(result, f)

"""The regenerate stage, Hugging Face backend: a shard's assistant turns answered by the target.

`eyrie regenerate --target DIR --inputs F [F ...] --shard S --out FILE --settings JSON` writes
`shard_SSS.jsonl`: one line per usable record of shard S, in input order, each with its status
(docs/contracts.md#files), and logs what it did. The target runs under transformers' `generate`
on regenerate.device, left-padded batches of regenerate.batch_size prompts; with
regenerate.backend: vllm the workflow runs `eyrie regenerate-vllm` in the vLLM environment
instead. docs/data.md#regeneration.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from eyrie.arch.loader import load_causal_lm
from eyrie.chat.template import end_token_ids, load_chat_tokenizer
from eyrie.config.sections import RegenSettings
from eyrie.core.errors import DataError
from eyrie.core.io import provenance
from eyrie.core.runtime import auto_device, auto_dtype
from eyrie.regenerate.jobs import Generated, split_at_end
from eyrie.regenerate.regeneration import add_shard_arguments, run_shard, target_context

log = logging.getLogger(__name__)


class HfBackend:
    """The target under transformers' generate: greedy (temperature 0) or sampled, nothing from
    the model's generation_config but its end tokens (vLLM's backend samples the same way)."""

    def __init__(self, tokenizer, model, cfg: RegenSettings, context: int | None = None):
        from transformers import GenerationConfig

        self.tokenizer, self.model, self.cfg, self.context = tokenizer, model, cfg, context
        self.batch_size = cfg.batch_size
        self.ends = end_token_ids(tokenizer, model.generation_config.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad = pad if pad is not None else min(self.ends, default=0)
        # the model's own sampling defaults (top_k, repetition_penalty, ...) would change the
        # distribution the settings name; generate fills unset values from this config
        model.generation_config = GenerationConfig(
            eos_token_id=sorted(self.ends) or None, pad_token_id=self.pad
        )

    def _sampling(self) -> dict:
        cfg = self.cfg
        if not cfg.sampled:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}

    def generate(self, prompts: list[list[int]]) -> list[Generated]:
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)  # [B, T] left-padded
        mask = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, T] 1 = prompt token
        for b, prompt in enumerate(prompts):
            ids[b, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[b, width - len(prompt) :] = 1
        device = self.model.device
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=self.cfg.max_new_tokens,
                **self._sampling(),
            )
        return [split_at_end(row[width:].tolist(), self.ends) for row in out.cpu()]


def load_backend(target: str | Path, cfg: RegenSettings) -> HfBackend:
    import torch

    device = auto_device("regenerate.device", cfg.device, DataError)
    tokenizer = load_chat_tokenizer(target, cfg.trust_remote_code)
    torch.manual_seed(cfg.seed)
    dtype = auto_dtype("auto", device)  # bfloat16 on a GPU, float32 on the CPU
    model = load_causal_lm(target, device, dtype, cfg.trust_remote_code, DataError)
    log.info("regenerate: target %s on %s (%s)", target, device, model.dtype)
    return HfBackend(tokenizer, model, cfg, target_context(target))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shard_arguments(parser)


def run(args: argparse.Namespace) -> int:
    cfg = RegenSettings.from_settings(args.settings)
    if cfg.backend != "hf":
        raise DataError(
            "regenerate.backend is vllm: run `<vllm.python> -m eyrie.cli regenerate-vllm` "
            "(the workflow does), or set regenerate.backend: hf"
        )
    log.info("regenerate: provenance %s", json.dumps(provenance(args.settings), default=str))
    return run_shard(args, cfg, lambda: load_backend(args.target, cfg))

"""The regenerate stage, vLLM backend: a shard's assistant turns answered by the target in vLLM.

`{vllm.python} -m eyrie.cli regenerate-vllm --target DIR --inputs F [F ...] --shard S --out FILE
--settings JSON [--gpu-memory-utilization F]` writes the same `shard_SSS.jsonl` as `eyrie
regenerate` (eyrie.regenerate.regeneration does all but the generation): one `vllm.LLM` with
vllm.tensor_parallel_size GPUs, each round's prompts sent as token ids at once, sampled with the
regenerate settings; a response that stops for its length is cut. Runs in the vLLM environment:
never imports eyrie.train. docs/data.md#regeneration, docs/vllm.md.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from eyrie.chat.template import end_token_ids, generation_eos, load_chat_tokenizer
from eyrie.config.sections import RegenSettings, VllmSettings, vllm_runtime
from eyrie.core.errors import DataError
from eyrie.core.io import provenance
from eyrie.regenerate.jobs import Generated, split_at_end
from eyrie.regenerate.regeneration import (
    CHUNK_RECORDS,
    add_shard_arguments,
    run_shard,
    target_context,
)
from eyrie.vllm import fatbin
from eyrie.vllm.engine import bound_kwargs, bounds, engine_args

log = logging.getLogger(__name__)


def parse_settings(
    settings: dict, gpu_memory_utilization: float | None = None
) -> tuple[RegenSettings, VllmSettings]:
    """The regenerate and vllm sections (schema-checked, every problem at once);
    `gpu_memory_utilization` (the CLI flag, not compared by the workflow) wins over the
    section's."""
    if not isinstance(settings.get("vllm"), dict):
        raise DataError("invalid --settings: vllm: missing; pass the config's vllm section")
    cfg = RegenSettings.from_settings(settings, vllm_runtime(gpu_memory_utilization, DataError))
    vllm = cfg.vllm
    if cfg.backend != "vllm":
        raise DataError(
            "regenerate.backend is hf: run `eyrie regenerate` (the workflow does), or set "
            "regenerate.backend: vllm"
        )
    return cfg, vllm


def engine_kwargs(target: str | Path, cfg: RegenSettings, vllm: VllmSettings) -> dict:
    """`vllm.LLM(**kwargs)`: the target on vllm.tensor_parallel_size GPUs, prompts as token ids
    (the tokenizer runs in eyrie, not in vLLM), sampled with the regenerate seed. Its lengths
    (eyrie.vllm.engine.bounds): a round's prompts hold the turns regenerated before them, so the
    longest is not known at the start: vllm.max_model_len, else the target's context, with
    chunked prefill (vLLM profiles a step of max_num_batched_tokens, not of the context)."""
    context = vllm.max_model_len or target_context(target)
    lengths = (
        bound_kwargs(bounds(vllm, context, chunked=True, source="the target's context"))
        if context
        else {}
    )
    return engine_args(
        Path(target).resolve(),
        vllm,
        trust_remote_code=cfg.trust_remote_code,
        seed=cfg.seed,
        **lengths,
    )


def sampling_kwargs(cfg: RegenSettings, ends: set[int]) -> dict:
    """`vllm.SamplingParams(**kwargs)`: the Hugging Face backend's sampling, the same end tokens
    (ignore_eos: only these stop it, not the eos vLLM would add of its own)."""
    sampled = cfg.sampled
    return {
        "max_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature if sampled else 0.0,
        "top_p": cfg.top_p if sampled else 1.0,
        "seed": cfg.seed,
        "ignore_eos": True,
        "stop_token_ids": sorted(ends),
        "detokenize": False,
    }


def to_generated(output, ends: set[int]) -> Generated:
    """A vLLM RequestOutput's first completion: its ids before the end token, cut when vLLM
    stopped it for its length."""
    completion = output.outputs[0]
    split = split_at_end(list(completion.token_ids), ends)
    return Generated(split.ids, completion.finish_reason != "length", split.end)


class VllmBackend:
    """One vLLM engine; each round's prompts go in one generate call (vLLM batches them)."""

    batch_size = CHUNK_RECORDS

    def __init__(self, tokenizer, llm, params, ends: set[int], context: int | None):
        self.tokenizer, self.llm, self.params, self.ends = tokenizer, llm, params, ends
        self.context = context

    def generate(self, prompts: list[list[int]]) -> list[Generated]:
        results = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts], self.params, use_tqdm=False
        )
        for ids, result in zip(prompts, results, strict=True):
            if list(result.prompt_token_ids) != ids:
                raise RuntimeError("vLLM returned outputs in another order than the prompts")
        return [to_generated(result, self.ends) for result in results]


def load_backend(target: str | Path, cfg: RegenSettings, vllm: VllmSettings) -> VllmBackend:
    from vllm import LLM, SamplingParams

    tokenizer = load_chat_tokenizer(target, cfg.trust_remote_code)
    ends = end_token_ids(tokenizer, generation_eos(target))
    if not ends:
        raise DataError(
            f"{target}: neither the tokenizer nor generation_config.json names an eos token; "
            "a response would only ever stop at regenerate.max_new_tokens"
        )
    waited = fatbin.wait_for_compilation()  # compile-kernels compiling this target's kernels
    if waited > 0.5:
        log.info("waited %.1f s for compile-kernels (its kernels load from the cache)", waited)
    llm = LLM(**engine_kwargs(target, cfg, vllm))
    params = SamplingParams(**sampling_kwargs(cfg, ends))
    context = vllm.max_model_len or target_context(target)
    return VllmBackend(tokenizer, llm, params, ends, context)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shard_arguments(parser)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's share of each GPU's memory (default: the settings' vllm section)",
    )


def run(args: argparse.Namespace) -> int:
    cfg, vllm = parse_settings(args.settings, args.gpu_memory_utilization)
    log.info("regenerate: provenance %s", json.dumps(provenance(args.settings), default=str))
    return run_shard(args, cfg, lambda: load_backend(args.target, cfg, vllm))

"""The arguments of `vllm.LLM` for a target, built from the typed `vllm` section: one builder for
the three engines eyrie starts (regeneration, extraction, the evaluation's two runs), so each
reads the section the same way. A stage adds what is its own (seed, dtype, speculative or
connector settings) as keyword arguments. Imports no vLLM: the evaluation builds its engines'
arguments in the process that starts them. docs/vllm.md.
"""

from __future__ import annotations

from pathlib import Path

from eyrie.config.sections import VllmSettings
from eyrie.core.rehearsal import engine_kwargs
from eyrie.vllm.adapters import text_only

# The tokens of one engine step where the user sets none: vLLM's own default for offline engines
# on GPUs of 70 GiB and more, chosen here whatever the GPU (preflight predicts with it).
BATCH_TOKENS = 16384
# Requests per engine step. vLLM's memory profiling samples this many rows over the whole
# vocabulary (~20 bytes per entry: 3.1 GiB for 1024 rows of Kimi-K2.5's 163,840 tokens).
# Extraction asks one token per sample, so 256 (samples of 64 tokens on average fill a step);
# generating engines (evaluation, regeneration) keep vLLM's default for offline engines.
EXTRACT_SEQS, GENERATE_SEQS = 256, 1024
# beyond a sample, an extraction request holds the one token it asks for and, on the native path,
# the one speculative slot of the extract_hidden_states method
EXTRACT_EXTRA = 2


def bounds(vllm: VllmSettings, longest: int, *, chunked: bool, source: str) -> dict:
    """The lengths of an engine whose longest sequence is `longest` tokens (`source` says where
    that figure comes from): `max_model_len` (vllm.max_model_len, else `longest`),
    `max_num_batched_tokens` (the tokens of one step, which vLLM's memory profiling runs at once:
    vllm.max_num_batched_tokens, else BATCH_TOKENS, and without chunked prefill at least
    max_model_len, since a prompt then goes in one step) and `max_num_seqs`. vLLM's own default
    for max_model_len, the target's context (262,144 for Kimi-K2.5), makes an extraction engine
    profile a step that long (docs/vllm.md, GPU memory)."""
    model_len = vllm.max_model_len or int(longest)
    batch = vllm.max_num_batched_tokens or BATCH_TOKENS
    if not chunked and vllm.max_num_batched_tokens is None:
        batch = max(batch, model_len)
    return {
        "max_model_len": model_len,
        "max_num_batched_tokens": batch,
        "max_num_seqs": min(GENERATE_SEQS if chunked else EXTRACT_SEQS, batch),
        "from": "vllm.max_model_len" if vllm.max_model_len else source,
    }


def bound_kwargs(b: dict) -> dict:
    """The engine arguments of `bounds(...)` (without its `from`)."""
    return {k: b[k] for k in ("max_model_len", "max_num_batched_tokens", "max_num_seqs")}


def engine_args(target: str | Path, vllm: VllmSettings, **stage) -> dict:
    """`vllm.LLM(**engine_args(...))` for the target folder `target` (passed as given):
    vllm.tensor_parallel_size GPUs, vllm.gpu_memory_utilization of each, vllm.enforce_eager,
    vllm.dtype and vllm.max_model_len; prompts go as token ids and outputs come back as ids, so
    no tokenizer code runs in vLLM (a tokenizer saved by another transformers version than the
    vLLM environment's cannot break it); a multimodal wrapper's text model only; in a rehearsal
    (vllm.rehearsal), random target weights. `stage`: the stage's own arguments, which replace
    the section's of the same name (seed 0 unless given)."""
    return {
        "model": str(target),
        "tensor_parallel_size": vllm.tensor_parallel_size,
        "gpu_memory_utilization": vllm.gpu_memory_utilization,
        "enforce_eager": vllm.enforce_eager,
        "max_model_len": vllm.max_model_len,
        "dtype": vllm.dtype,
        "skip_tokenizer_init": True,
        "seed": 0,
        **stage,
        **text_only(target),
        **engine_kwargs(vllm.rehearsal),  # random weights: docs/rehearsal.md
    }

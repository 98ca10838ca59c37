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

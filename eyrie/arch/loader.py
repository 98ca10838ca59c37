"""The one loader of a target as a Hugging Face causal LM (regeneration, the hf extraction
backend, the Hugging Face evaluation): transformers' AutoModelForCausalLM in the given dtype, on
the given device, in eval mode. A folder transformers cannot load is one error of the caller's
type naming the folder and the fix.
"""

from __future__ import annotations

from pathlib import Path


def load_causal_lm(
    path: str | Path, device: str, dtype, trust_remote_code: bool, error: type[Exception]
):
    """The model of `path` in `dtype` (a torch.dtype or its name) on `device`, in eval mode;
    `error` (an EyrieError type) when transformers cannot load the folder."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, SafetensorError) as exc:
        raise error(
            f"{path}: cannot load the target with transformers ({exc}); check the model "
            "folder (and trust_remote_code if it ships its own code)"
        ) from exc
    return model.to(device).eval()

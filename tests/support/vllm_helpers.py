"""Shared by the vLLM preflight tests: target configs, target folders and the REAL facts of the
installed vLLM (.venv-vllm), gathered once per test session for all configs in one subprocess
(eyrie.preflight.vllm_env caches them per process)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from eyrie.preflight.vllm_env import facts_for
from eyrie.vllm.facts import VllmFacts
from tests.support import REPO

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
NO_VLLM = (
    f"no vLLM environment at {VLLM_PYTHON.parent.parent}: `bash scripts/setup-vllm.sh` makes "
    "it (.ci/run does, before pytest)"
)
need_vllm = pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=NO_VLLM)


def _pin(requirements: Path) -> str:
    """The vLLM version a requirements file pins (also on its `# no-deps:` line)."""
    return re.search(r"^(?:# no-deps: )?vllm==(\S+)", requirements.read_text(), re.M)[1]


# every vLLM environment scripts/setup-vllm.sh makes: version -> its python (envs/vllm.txt is the
# default, .venv-vllm; envs/vllm-X.txt is .venv-vllm-X)
VLLM_ENVS = {_pin(REPO / "envs" / "vllm.txt"): VLLM_PYTHON} | {
    _pin(req): REPO / f".venv-vllm-{req.stem.removeprefix('vllm-')}" / "bin" / "python"
    for req in sorted((REPO / "envs").glob("vllm-*.txt"))
}


def vllm_env(version: str) -> Path:
    """The python of the environment for `version`: a skip where it is missing, a failure where
    the environments are part of the setup (.ci/run sets EYRIE_REQUIRE_VLLM)."""
    python = VLLM_ENVS[version]
    if not python.is_file():
        reason = (
            f"no vLLM {version} environment at {python.parent.parent}: "
            "`bash scripts/setup-vllm.sh all`"
        )
        (pytest.fail if os.environ.get("EYRIE_REQUIRE_VLLM") else pytest.skip)(reason)
    return python


def need_cuda(python: Path | str) -> None:
    """Skip unless `python` (a vLLM environment's) sees a CUDA device."""
    cuda = subprocess.run(
        [str(python), "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
    )
    if cuda.stdout.strip() != "True":
        pytest.skip(f"{python} sees no CUDA device")


LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 320,
    "torch_dtype": "bfloat16",
}
# a tiny DeepSeek-V3, with the routing keys (scoring_func, topk_method, ...) vLLM's MoE needs
DEEPSEEK = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 320,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
}
# Kimi-K2.5's shape: a multimodal wrapper, the language model in text_config only
KIMI_K25 = {
    "model_type": "kimi_k25",
    "architectures": ["KimiK25ForConditionalGeneration"],
    "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
    "text_config": {
        "model_type": "kimi_k2",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "vocab_size": 163840,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
    },
}
# a Llama whose architectures[0] no vLLM knows
UNKNOWN_ARCH = {**LLAMA, "architectures": ["LlamaNextForCausalLM"]}
# a tiny Qwen3-MoE and a tiny gpt-oss (sliding-window and full attention layers)
QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 320,
    "torch_dtype": "bfloat16",
}
GPT_OSS = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 128,
    "vocab_size": 320,
    "torch_dtype": "bfloat16",
}
REAL_CONFIGS = {
    "llama": LLAMA,
    "deepseek": DEEPSEEK,
    "kimi": KIMI_K25,
    "unknown_arch": UNKNOWN_ARCH,
    "qwen3_moe": QWEN3_MOE,
    "gpt_oss": GPT_OSS,
}


def real_facts(python: Path = VLLM_PYTHON) -> dict[str, VllmFacts]:
    """An installed vLLM's facts for every REAL_CONFIGS entry (one subprocess per session and
    environment)."""
    got = facts_for(python, list(REAL_CONFIGS.values()))
    return {name: VllmFacts.from_json(g) for name, g in zip(REAL_CONFIGS, got)}


def write_target(path: Path, config: dict, weights_gib: float | None = None) -> Path:
    """A target folder holding config.json and, with `weights_gib`, a SPARSE model.safetensors of
    that size (its bytes are what preflight's memory estimate reads; it takes no disk)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if weights_gib is not None:
        with open(path / "model.safetensors", "wb") as f:
            f.truncate(int(weights_gib * 1024**3))
    return path


def vllm_settings(**vllm) -> dict:
    """Preflight settings for vLLM extraction (and what the config's defaults say)."""
    v = {
        "python": str(VLLM_PYTHON),
        "extraction_path": "auto",
        "tensor_parallel_size": 1,
        "gpu_memory_gib": 80,
        "gpu_memory_utilization": 0.85,
        "enforce_eager": True,
        "max_model_len": None,
    }
    v.update(vllm)
    return {
        "extract": {"backend": "vllm", "storage_dtype": "bfloat16"},
        "eval": {"vllm": False},
        "vllm": v,
    }

"""The extraction tests' case (tests/extract): a tiny Llama or DeepseekV3 target with a chat
tokenizer, a tokenized parquet shard of samples of mixed lengths, a passing preflight report, and
the settings and argv of `eyrie extract` on them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eyrie.arch.target import inspect_target
from eyrie.demo.tokenizer import build_chat_tokenizer
from tests.support.models import TEXTS, random_model, save_target, tiny_llama
from tests.support.stages import options

# lengths chosen so that batches mix samples of different lengths (padding inside a batch)
LENGTHS = [5, 23, 1, 17, 40, 9, 33, 12, 28, 2, 19]
AUX = [1, 2, 3]


def make_config(kind: str, vocab_size: int):
    """A tiny "llama" or "deepseek_v3" (MLA attention, MoE after the first layer) config."""
    from transformers import DeepseekV3Config

    if kind == "llama":
        return tiny_llama(vocab_size, max_position_embeddings=256)
    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
        max_position_embeddings=256,
    )


def write_tokenized(path: Path, ids, masks, sample_ids: list[str] | None = None) -> Path:
    """A tokenized parquet shard of these samples (ids, masks: one array or list per sample)."""
    names = sample_ids or [f"conv.jsonl:{i + 1}" for i in range(len(ids))]
    columns = {
        "sample_id": names,
        "input_ids": pa.array([list(map(int, x)) for x in ids], type=pa.list_(pa.int32())),
        "loss_mask": pa.array([list(map(int, m)) for m in masks], type=pa.list_(pa.uint8())),
    }
    pq.write_table(pa.table(columns), path)
    return path


def build_case(tmp_path: Path, kind: str):
    """A saved tiny target with tokenizer, a tokenized parquet shard and a passing preflight:
    (target, shard, preflight, ids, masks)."""
    tok = build_chat_tokenizer(TEXTS, vocab_size=300)
    # larger random weights: hidden states that differ clearly per layer
    model = random_model(make_config(kind, len(tok)), std=0.2)
    target = save_target(tmp_path / f"target-{kind}", model, tok)

    rng = np.random.default_rng(1)
    ids = [rng.integers(0, len(tok), n).astype(np.int32) for n in LENGTHS]
    masks = [(rng.random(n) < 0.5).astype(np.uint8) for n in LENGTHS]
    shard = write_tokenized(tmp_path / "shard_000.parquet", ids, masks)
    preflight = tmp_path / "preflight.json"
    preflight.write_text(
        json.dumps({"ok": True, "target": {"fingerprint": inspect_target(target).fingerprint}})
    )
    return target, shard, preflight, ids, masks


def settings(max_tokens: int, storage: str = "bfloat16") -> dict:
    """The extract stage's settings: Hugging Face on the CPU in float32, stored as `storage`."""
    return {
        "extract": {
            "backend": "hf",
            "device": "cpu",
            "dtype": "float32",
            "storage_dtype": storage,
            "max_tokens_per_batch": max_tokens,
        },
        "layers": {"aux_ids": AUX},
        "trust_remote_code": False,
    }


def extract_args(target: Path, shard: Path, preflight: Path, out: Path, cfg: dict) -> list[str]:
    """The options of `eyrie extract` on one shard (after the stage name)."""
    return options(target=target, shard=shard, preflight=preflight, out=out, settings=cfg)

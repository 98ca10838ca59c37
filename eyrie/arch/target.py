"""What eyrie reads from a target model folder: config.json, the tokenizer hash, the layer ids.

Nothing here executes code from a model folder: config.json is read as JSON. The architecture
itself comes from eyrie.arch.registry.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from eyrie.arch.registry import Architecture, architecture_for
from eyrie.core.errors import TargetError

# Files whose bytes define the tokenizer (hashed into every shard).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "tiktoken.model",
)


@dataclass(frozen=True)
class TargetInfo:
    path: Path
    model_type: str  # of the language model (text_config's when present)
    wrapper_model_type: str | None  # e.g. kimi_k25 for a multimodal wrapper
    architecture: Architecture
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    torch_dtype: str | None
    needs_remote_code: bool
    text_config: dict = field(repr=False)
    fingerprint: str = ""

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.hidden_size * 2  # bf16


def read_config(path: str | Path) -> dict:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise TargetError(f"{cfg_path}: not found; set target.path to a Hugging Face model folder")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise TargetError(
            f"{cfg_path}: not valid JSON ({exc}); re-save the model's config"
        ) from exc


def fingerprint(config: dict) -> str:
    """Hash of config.json's content (key order and whitespace do not matter)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def tokenizer_hash(path: str | Path) -> str:
    h = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        f = Path(path) / name
        if f.is_file():
            found = True
            h.update(name.encode() + b"\0" + f.read_bytes())
    if not found:
        raise TargetError(
            f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); "
            "save the tokenizer next to the model"
        )
    return h.hexdigest()[:16]


def inspect_target(path: str | Path) -> TargetInfo:
    """Read config.json (using text_config when present) and look up the architecture."""
    config = read_config(path)
    text = config.get("text_config") or config
    wrapper = config.get("model_type") if "text_config" in config else None
    model_type = text.get("model_type")
    architecture = architecture_for(model_type, str(Path(path) / "config.json"))
    missing = [
        k
        for k in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")
        if not isinstance(text.get(k), int)
    ]
    if missing:
        where = "text_config." if wrapper else ""
        raise TargetError(f"{Path(path) / 'config.json'}: missing integer {where}{missing[0]}")
    needs_remote = "auto_map" in config or "auto_map" in text
    tok_cfg = Path(path) / "tokenizer_config.json"
    if tok_cfg.is_file():
        try:
            needs_remote = needs_remote or "auto_map" in json.loads(tok_cfg.read_text())
        except json.JSONDecodeError as exc:
            raise TargetError(f"{tok_cfg}: not valid JSON ({exc})") from exc
    return TargetInfo(
        path=Path(path),
        model_type=model_type,
        wrapper_model_type=wrapper,
        architecture=architecture,
        num_hidden_layers=text["num_hidden_layers"],
        hidden_size=text["hidden_size"],
        vocab_size=text["vocab_size"],
        num_attention_heads=text["num_attention_heads"],
        torch_dtype=text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype"),
        needs_remote_code=needs_remote,
        text_config=text,
        fingerprint=fingerprint(config),
    )


def default_aux_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def resolve_layer_ids(aux_ids: list[int] | None, num_layers: int) -> tuple[list[int], int]:
    """Return (aux ids, final id N) in vLLM semantics, validated.

    Id k is the residual stream entering decoder layer k; id N is the last layer's output
    before the final norm (always captured: the training targets come from it).
    """
    key = "layers.aux_ids"
    ids = list(aux_ids) if aux_ids is not None else default_aux_ids(num_layers)
    origin = (
        f"{key}={ids}"
        if aux_ids is not None
        else (f"{key}=null gives the default [2, N//2, N-3] = {ids} for N={num_layers}")
    )
    fix = f"set {key} to strictly increasing ids within 1..{num_layers - 1}"
    if len(set(ids)) != len(ids):
        raise TargetError(f"{origin}: duplicate ids; {fix}")
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise TargetError(
            f"{origin}: id {bad[0]} is out of range for a {num_layers}-layer target; {fix}"
        )
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise TargetError(f"{origin}: ids are not increasing; {fix}")
    return ids, num_layers


def get_submodule(model, dotted: str):
    obj = model
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj

"""What vLLM's draft loaders do with a draft's config.json, run on a CPU on stand-ins: its
speculators converters (one per method: eagle3, dflash, dspark), which turn a speculators-format
config into the model config vLLM serves.
- `draft_fields`: the eagle3 converter applied to a draft config setting every field: the fields
  it carries;
- `eagle3_draft_class`: the class it names for a draft of a layer type (llama, qwen3);
- `block_draft`: a block drafter's converter applied to a draft config that records which fields
  it reads, and the class it names.
Runs in the vLLM environment (imports vllm inside the functions); eyrie.vllm.facts inspects the
classes named. See docs/vllm.md.
"""

from __future__ import annotations


def converter(method: str):
    """vLLM's speculators converter for `method` (a function of (draft config, served config)),
    or None where this vLLM has none."""
    try:
        from vllm.transformers_utils.configs.speculators import algos

        return algos.SUPPORTED_SPECULATORS_TYPES[method]
    except (ImportError, AttributeError, KeyError):
        return None


def eagle3_draft_class(kind: str) -> str | None:
    """The class the eagle3 converter names for a draft whose layers are of `kind`
    (transformer_layer_config.model_type); None where it has no converter or refuses the kind."""
    convert, served = converter("eagle3"), {"model_type": kind}
    if convert is None:
        return None
    try:
        convert({}, served)
    except Exception:  # noqa: BLE001 - a kind this vLLM refuses
        return None
    return (served.get("architectures") or [None])[0]


def draft_fields() -> tuple[list[str] | None, str]:
    """The draft config.json fields vLLM's speculators "eagle3" converter carries into the
    model config it serves: the converter run on a draft config setting every field."""
    convert = converter("eagle3")
    if convert is None:
        return None, "unknown: no speculators eagle3 converter"
    marker = object()
    draft = {
        f: marker
        for f in (
            "draft_vocab_size",
            "target_hidden_size",
            "norm_before_residual",
            "norm_before_fc",
            "fc_norm",
            "norm_output",
            "eagle_aux_hidden_state_layer_ids",
            "embed_requires_grad",
        )
    }
    served: dict = {"model_type": "llama"}
    try:
        convert(draft, served)
    except Exception as exc:  # noqa: BLE001
        return None, f"unknown: the eagle3 converter failed on a stand-in ({exc})"
    return sorted(k for k, v in served.items() if v is marker), "the eagle3 converter run"


class _Reading(dict):
    """A draft config.json that records every key read from it (present or not)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


# a block drafter's config.json as speculators writes it (values of the right types), for the
# converters to read; which keys they read is what block_draft reports
BLOCK_DRAFT_STAND_IN = {
    "draft_vocab_size": 32,
    "target_hidden_size": 64,
    "mask_token_id": 0,
    "aux_hidden_state_layer_ids": [1, 2, 3],
    "block_size": 8,
    "sample_from_anchor": False,
    "sliding_window_non_causal": False,
    "markov_rank": 8,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}


def block_draft(method: str) -> tuple[str | None, list[str] | None, str]:
    """(the class vLLM serves a `method` draft with, the config.json fields its speculators
    converter reads, how): the converter run on BLOCK_DRAFT_STAND_IN; None where this vLLM has
    no converter for the method or it fails on the stand-in."""
    convert = converter(method)
    if convert is None:
        return None, None, f"no speculators {method!r} converter in this vLLM"
    draft, served = _Reading(BLOCK_DRAFT_STAND_IN), {"model_type": "qwen3"}
    try:
        convert(draft, served)
    except Exception as exc:  # noqa: BLE001
        return None, sorted(draft.read), f"the {method} converter failed on a stand-in ({exc})"
    archs = served.get("architectures") or [None]
    return archs[0], sorted(draft.read), f"the {method} converter run on a stand-in draft config"

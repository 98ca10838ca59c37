"""The exported draft's format (docs/export-format.md): the config fields every export writes,
the draft layer types and the flags vLLM serves, speculators' loader, and `validate_export`, which
requires a folder to load in speculators with exactly the trained draft's tensors and outputs.
Imports nothing from eyrie.train: the vLLM evaluation reads its constants in the vLLM environment.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from eyrie.arch.methods import BLOCK_METHODS, DRAFT_METHODS
from eyrie.core.errors import ExportError

log = logging.getLogger(__name__)


# Every field written to config.json; vLLM falls back to its own defaults for missing ones,
# which differ from speculators' (norm_before_residual: vLLM True, speculators False).
CONFIG_FIELDS = (
    "speculators_model_type",
    "architectures",
    "transformer_layer_config",
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "embed_requires_grad",
    "speculators_config",
)


# ... and every block drafter's (speculators' DFlash and DSpark configs; DSpark adds its Markov
# and confidence heads' fields, which speculators always writes)
BLOCK_CONFIG_FIELDS = (
    "speculators_model_type",
    "architectures",
    "transformer_layer_config",
    "draft_vocab_size",
    "target_hidden_size",
    "aux_hidden_state_layer_ids",
    "block_size",
    "mask_token_id",
    "sample_from_anchor",
    "speculators_config",
)


DRAFT_ARCHS = ("llama", "qwen3")  # transformer_layer_config.model_type vLLM serves for EAGLE-3
# Flags that change the network but that vLLM 0.22 does not read: it would serve another model.
UNSERVABLE_FLAGS = {
    "norm_output": "vLLM 0.22 does not read norm_output and would feed un-normed hidden states "
    "back across draft steps",
    "fc_norm": "vLLM 0.22 does not read fc_norm and would skip the per-layer norms before fc",
}


def load_draft(
    path: str | Path, *, verifier: str | Path | None = None, attn_implementation: str = "sdpa"
):
    """Load a draft folder with speculators' own class for its speculators_model_type
    (Eagle3DraftModel, DFlashDraftModel, DSparkDraftModel).from_pretrained.

    The default attention (flex) cannot run TTT steps > 1 on CPU for short batches, so this
    selects `attn_implementation` (sdpa) in the config; `verifier` replaces the verifier path
    recorded in the folder (the verifier's lm_head/norm are loaded from it).
    """
    from speculators import SpeculatorModel

    method = json.loads((Path(path) / "config.json").read_text()).get("speculators_model_type")
    if method not in DRAFT_METHODS:
        raise ValueError(f"speculators_model_type {method!r} is not one of {list(DRAFT_METHODS)}")
    model_class = SpeculatorModel.registry[method]
    config = model_class.config_class.from_pretrained(str(path))
    if verifier is not None:
        config.speculators_config.verifier.name_or_path = str(verifier)
    config.transformer_layer_config._attn_implementation = attn_implementation
    return model_class.from_pretrained(str(path), config=config)


def is_block(model) -> bool:
    """Whether a speculators draft is a block drafter (DFlash, DSpark) rather than EAGLE-3."""
    return model.config.speculators_model_type in BLOCK_METHODS


def expected_tensors(model) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape the export must hold: the draft's state without the tensors its class
    leaves out of a checkpoint (verifier_*: the target's own norm/lm_head; a block drafter's
    embedding, the target's too), which every client loads from the verifier."""
    left_out = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    return {
        k: tuple(v.shape)
        for k, v in model.state_dict().items()
        if not k.startswith("verifier_") and k not in left_out
    }


def random_packed_batch(model, seed: int = 0, ttt_steps: int = 3) -> dict[str, torch.Tensor]:
    """Two documents, each longer than `ttt_steps` (every TTT step has tokens left to predict),
    and trailing padding: hidden_states float32 [1, T, n_aux*H], verifier_last_hidden_states
    float32 [1, T, H], input_ids/position_ids/document_ids int64 [1, T], loss_mask bool [1, T]."""
    g = torch.Generator().manual_seed(seed)
    H = model.hidden_size
    n_aux = model.fc.in_features // H
    lengths, pad = (ttt_steps + 6, ttt_steps + 3), 3
    T = sum(lengths) + pad
    return {
        "hidden_states": torch.randn(1, T, n_aux * H, generator=g),
        "verifier_last_hidden_states": torch.randn(1, T, H, generator=g),
        "input_ids": torch.randint(0, model.verifier_vocab_size, (1, T), generator=g),
        "document_ids": torch.tensor([[0] * lengths[0] + [1] * lengths[1] + [-1] * pad]),
        "position_ids": torch.tensor(
            [list(range(1, lengths[0] + 1)) + list(range(1, lengths[1] + 1)) + [0] * pad]
        ),
        "loss_mask": torch.tensor([[True] * lengths[0] + [True] * lengths[1] + [False] * pad]),
    }


@torch.no_grad()
def draft_outputs(model, batch: dict, ttt_steps: int) -> dict[str, torch.Tensor]:
    """Logits of every draft forward ([1, T, draft_vocab] each for EAGLE-3's TTT steps; a block
    drafter's blocks at every anchor in one), captured at lm_head, its draft tokens (EAGLE-3)
    and its loss against the batch's verifier states. Anchors are drawn with a fixed seed, so
    two drafts are compared on the same blocks."""
    from speculators.losses import resolve_loss_config

    logits: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda mod, args, out: logits.append(out.clone()))
    was_training = model.training
    model.eval()
    if is_block(model):
        kwargs, _ = type(model).get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager")
    else:
        kwargs = dict(ttt_steps=ttt_steps, loss_config=resolve_loss_config("kl_div", "eager"))
    try:
        # speculators compiles forward whenever CUDA is present, even for a CPU model; the
        # comparison runs eagerly on CPU (deterministic, and no C++ toolchain needed).
        with torch.compiler.set_stance("force_eager"), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            tokens, loss, _ = model(**batch, **kwargs)
    finally:
        handle.remove()
        model.train(was_training)
    out = {f"logits_{k}": x for k, x in enumerate(logits)}
    if not is_block(model):
        out.update({f"tokens_{k}": x for k, x in enumerate(tokens)})
    out["loss"] = loss
    return out


def check_config(config: dict, where: Path, expect: dict) -> None:
    """Every field present and non-null; the values we set are the values written."""
    fields = BLOCK_CONFIG_FIELDS if config.get("speculators_model_type") in BLOCK_METHODS else None
    missing = [k for k in fields or CONFIG_FIELDS if config.get(k) is None]
    if missing:
        raise ExportError(f"{where}: fields {missing} missing or null; the export must set them")
    for key, want in expect.items():
        have = config
        for part in key.split("."):
            have = have[int(part)] if isinstance(have, list) else have.get(part)
        if have != want:
            raise ExportError(f"{where}: {key} is {have!r}, expected {want!r}")


def validate_export(folder: Path, reference, ttt_steps: int, expect_config: dict) -> None:
    """Load `folder` with speculators and compare it with `reference` (the trained draft)."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    check_config(config, folder / "config.json", expect_config)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        have = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    want = expected_tensors(reference)
    if have != want:
        extra, lost = sorted(set(have) - set(want)), sorted(set(want) - set(have))
        shapes = sorted(k for k in set(have) & set(want) if have[k] != want[k])
        raise ExportError(
            f"{folder}/model.safetensors: tensors differ from the trained draft "
            f"(unexpected {extra}, missing {lost}, shape mismatch {shapes})"
        )
    loaded = load_draft(folder)
    mine, theirs = reference.state_dict(), loaded.state_dict()
    changed = sorted(k for k in want if not torch.equal(mine[k], theirs[k]))
    if changed:
        raise ExportError(
            f"{folder}/model.safetensors: {changed} differ from the trained draft's values; "
            "the export is not written"
        )
    batch = random_packed_batch(reference, ttt_steps=ttt_steps)
    a, b = draft_outputs(reference, batch, ttt_steps), draft_outputs(loaded, batch, ttt_steps)
    differ = [k for k in a if k not in b or not same_output(a[k], b[k])]
    if differ or a.keys() != b.keys():
        raise ExportError(
            f"{folder}: the draft loaded by speculators gives different {differ} "
            "than the trained draft; the export is not written"
        )


def same_output(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Token ids equal; float outputs equal to float32's rounding. Equal weights (checked bit for
    bit above) can still round differently in two forwards on a loaded CPU: MKL may split a
    matrix product otherwise (CI once saw logits_0 and the loss differ that way); a wrong
    config, norm or tensor moves them by orders of magnitude more."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)

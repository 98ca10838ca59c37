"""Preflight's checks of the target folder and the disk, shared by the preflight stage.

Weights in safetensors, a tokenizer whose chat template gives every sample conversation an
assistant loss mask, room for the hidden states. A check adds its problems, each with its fix, to
a `Check` instead of raising, so preflight reports them all at once (docs/vllm.md, What preflight
checks).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from eyrie.arch.target import tokenizer_hash
from eyrie.core.errors import EyrieError
from eyrie.formats.codecs import bytes_per_token
from eyrie.store.fingerprint import safetensors_header, safetensors_problem

log = logging.getLogger(__name__)


# A conversation every chat template must render with a non-empty assistant loss mask.
SAMPLE_CONVERSATIONS = [
    [
        {"role": "user", "content": "What does json.dumps do?"},
        {"role": "assistant", "content": "It serializes an object to a JSON formatted string."},
    ],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Eleven."},
    ],
]


DISK_HEADROOM = 1.10  # ask for 10% more than the estimate


@dataclass
class Check:
    problems: list[str]
    warnings: list[str]

    def problem(self, text: str) -> None:
        self.problems.append(text)


def check_weights(path: Path, check: Check, rehearsal: bool = False, tied: bool = False) -> dict:
    """Safetensors weights, each file as long as its header says (a cut copy fails here, in
    seconds, instead of when the GPU engine loads it), every file and tensor the index names
    present, and the tensors training reads from them (the embeddings, and the lm_head unless
    `tied`). A rehearsal reads no weights: none there is fine, and said so. Returns what was
    found, for preflight.json's `weights`."""
    index = path / "model.safetensors.index.json"
    files = sorted(path.glob("*.safetensors"))
    found = {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "checked": True}
    if not files and not index.is_file():
        if rehearsal:
            return {**found, "checked": False, "note": REHEARSAL_WITHOUT_WEIGHTS}
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            check.problem(
                f"{path}: weights are only in pickle files (.bin/.pt), which eyrie does not "
                "load; convert them to safetensors (save_pretrained(..., safe_serialization=True))"
            )
        else:
            check.problem(
                f"{path}: no *.safetensors weights found; point target.path at a complete "
                "Hugging Face model folder (or set vllm.rehearsal: true to rehearse without them)"
            )
        return found
    headers, problems = {}, len(check.problems)
    for f in files:
        problem = safetensors_problem(f)
        if problem:
            check.problem(f"{problem}; copy the file again from its source")
        else:
            headers[f.name] = safetensors_header(f)[1]
    weight_map = {t: name for name, header in headers.items() for t in header}
    if index.is_file():
        weight_map = _check_index(index, headers, check) or weight_map
    if not rehearsal and len(check.problems) == problems:  # a cut file names itself first
        _check_training_tensors(index if index.is_file() else path, weight_map, tied, check)
    return found


REHEARSAL_WITHOUT_WEIGHTS = (
    "weights not checked: no *.safetensors in the folder, which a rehearsal does not read (its "
    "engines load random weights, its training random embedding and lm_head rows)"
)


def _check_training_tensors(where: Path, weight_map: dict, tied: bool, check: Check) -> None:
    """The tensors training reads from the target, found as speculators' loader finds them
    (a name, or one ending in it, or a known alias: speculators.utils.loading)."""
    from speculators.utils.loading import _WEIGHT_ALIASES, _resolve_key

    wanted = ["embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    for name in wanted:
        if _resolve_key(name, weight_map) is None:
            aliases = ", ".join(_WEIGHT_ALIASES.get(name, []))
            check.problem(
                f"{where}: no tensor named *{name} (nor {aliases}), which training reads from the "
                f"target; copy the complete checkpoint (the file that holds it), or rehearse "
                "without weights (vllm.rehearsal: true)"
            )


def _check_index(index: Path, headers: dict, check: Check) -> dict | None:
    """The index's weight_map (None when unreadable), its files and tensors checked."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        weight_map = exc
    if not isinstance(weight_map, dict):
        check.problem(f"{index}: no readable weight_map ({weight_map}); copy the file again")
        return None
    wanted: dict[str, list[str]] = {}
    for tensor, name in weight_map.items():
        wanted.setdefault(name, []).append(tensor)
    for name, tensors in sorted(wanted.items()):
        if not (index.parent / name).is_file():
            check.problem(
                f"{index}: names {name} ({len(tensors)} tensors), which is not in the folder; "
                "copy the missing weight file"
            )
        elif name in headers:
            missing = [t for t in tensors if t not in headers[name]]
            if missing:
                check.problem(
                    f"{index.parent / name}: lacks {len(missing)} tensor(s) the index puts "
                    f"there (first: {missing[0]}); copy the file again from its source"
                )
    return weight_map


def check_tokenizer(
    path: Path, trust_remote_code: bool, check: Check, kwargs: dict | None = None
) -> tuple[str, dict] | None:
    """The tokenizer's hash and what its chat template does with `kwargs`
    (data.chat_template_kwargs): the mask mode `auto` picks for a multi-turn conversation with
    reasoning, the tool-argument form, the stop tokens; None with a problem if it cannot train
    anything."""
    from transformers import AutoTokenizer

    from eyrie.chat.records import Conversation, RecordError, _one_line
    from eyrie.chat.samples import MaskSettings, masked_samples, template_traits
    from eyrie.chat.template import ChatTemplate, tokenizer_files_problem

    problem = tokenizer_files_problem(path, trust_remote_code)
    if problem:
        check.problem(problem)
        return None
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any loader failure is reported with its type
        check.problem(
            f"{path}: tokenizer does not load ({type(exc).__name__}: {_one_line(exc)}); "
            "check the tokenizer files or set target.trust_remote_code if it ships code"
        )
        return None
    if not getattr(tok, "chat_template", None):
        check.problem(
            f"{path}: tokenizer has no chat template; add chat_template.jinja to the target folder"
        )
        return None
    try:
        tpl = ChatTemplate.of(tok, kwargs, _eos(path))
    except EyrieError as exc:
        check.problem(str(exc))
        return None
    rules = []
    for i, messages in enumerate(SAMPLE_CONVERSATIONS):
        try:
            masked = masked_samples(tpl, Conversation(messages), MaskSettings())
        except EyrieError as exc:
            if isinstance(exc, RecordError) and exc.reason == "template_rule":
                rules.append(exc.detail)  # a rule of the template for that record: not fatal
                continue
            check.problem(f"{path}: chat template fails on sample conversation {i}: {exc}")
            continue
        if not any(sum(mask) for _, mask in masked.samples):
            rules.append("all-zero loss mask")
    if len(rules) == len(SAMPLE_CONVERSATIONS):
        check.problem(
            f"{path}: the chat template trains no assistant turn of any sample conversation "
            f"({rules[0]}); the template must render assistant turns so their text can be "
            "located (docs/data.md#the-loss-mask)"
        )
    traits = template_traits(tpl)
    if not traits.renders:
        check.problem(f"{path}: {traits.detail}; fix the chat template")
    return tokenizer_hash(path), traits.as_dict()


def _eos(path: Path):
    """generation_config.json's eos ids (else config.json's); None where neither can be read:
    read_target reports those files."""
    from eyrie.chat.template import generation_eos

    try:
        return generation_eos(path)
    except EyrieError:
        return None


@dataclass(frozen=True)
class HiddenVolume:
    """What extraction will store: `tokens` training tokens, each with `n_states` hidden states
    (the aux layers' and the final one) of size `hidden` in `storage_dtype`."""

    tokens: int
    n_states: int
    hidden: int
    storage_dtype: str


def check_storage(volume: HiddenVolume, where: Path, check: Check) -> dict:
    """Room under `where` for `volume` with DISK_HEADROOM; the estimate for preflight.json."""
    tokens = volume.tokens
    # hidden states (+ float8_e4m3's two float32 scales) per token; input_ids and loss_mask add
    # 5 B more, not counted (<= 1% from hidden size 128 up)
    per_token = bytes_per_token(volume.storage_dtype, volume.n_states, volume.hidden)
    need = per_token * tokens
    probe = where
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need * DISK_HEADROOM > free:
        check.problem(
            f"{probe}: hidden states need ~{need / 1e9:.2f} GB ({tokens} tokens x "
            f"{per_token} B/token) but only {free / 1e9:.2f} GB are free; free disk, "
            "use fewer conversations or a smaller extract.storage_dtype"
        )
    return {
        "bytes_per_token": per_token,
        "tokens": tokens,
        "estimated_bytes": need,
        "free_bytes": free,
        "path": str(probe),
    }

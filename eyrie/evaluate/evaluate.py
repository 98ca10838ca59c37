"""Acceptance length of a draft by real greedy speculative decoding with a Hugging Face target.

The evaluate stage: checks the settings, the preflight report, the vocabulary map, the prompts and
the exported draft, then decodes every prompt with the trained draft and with an untrained baseline
(eyrie.evaluate.specdec: EAGLE-3 proposer, vLLM's metrics) and writes the report JSON and the plot.
Every speculative output is checked token for token against plain greedy decoding of the target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from eyrie.config.schema import load_settings
from eyrie.core.errors import EvaluateError
from eyrie.core.io import atomic_path, keep_last_good, provenance, write_json
from eyrie.core.rehearsal import draft_is_rehearsal, refusal
from eyrie.core.runtime import auto_device, auto_dtype
from eyrie.evaluate.specdec import (
    Decoding,
    Eagle3Proposer,
    SpecStats,
    greedy_generate,
    speculative_generate,
)
from eyrie.formats.report import read_report
from eyrie.formats.tokenized import read_prompts
from eyrie.formats.vocab import read_vocab

log = logging.getLogger(__name__)


UNTRAINED_SEED = 0


@dataclass(frozen=True)
class EvalSettings:
    K: int
    max_new_tokens: int
    num_prompts: int
    device: str  # resolved: cpu | cuda
    dtype: str  # resolved: float32 | bfloat16 | float16, the target's and the draft's


def parse_settings(settings: dict) -> EvalSettings:
    """The eval settings, checked by the schema (every problem at once, each naming its key), with
    the device resolved."""
    ev = load_settings(settings, ["eval"], EvaluateError)["eval"]
    device = auto_device("eval.device", ev["device"], EvaluateError)
    dtype = auto_dtype(ev["dtype"], device)
    return EvalSettings(
        ev["num_speculative_tokens"], ev["max_new_tokens"], ev["num_prompts"], device, dtype
    )


def read_preflight(path: str | Path, fingerprint: str, num_layers: int) -> list[int]:
    """The preflight report's aux_layer_ids, after checking it passed and matches the target."""
    path = Path(path)
    report = read_report(path, fingerprint)
    aux = report.get("aux_layer_ids")
    if not (isinstance(aux, list) and aux and all(isinstance(i, int) for i in aux)):
        raise EvaluateError(
            f"{path}: aux_layer_ids must be a non-empty list of integers; rerun `eyrie preflight`"
        )
    if any(not 0 <= i < num_layers for i in aux):
        raise EvaluateError(
            f"{path}: aux_layer_ids {aux} must lie within 0..{num_layers - 1} for "
            f"a target with {num_layers} layers; rerun `eyrie preflight`"
        )
    if report.get("final_layer_id") != num_layers:
        raise EvaluateError(
            f"{path}: final_layer_id {report.get('final_layer_id')!r} but the target "
            f"has {num_layers} layers; rerun `eyrie preflight`"
        )
    return aux


def load_draft(path: str | Path):
    """The exported draft through speculators' own loader (sdpa attention: dense masks, any
    device), with its weights checked finite."""
    import warnings

    from eyrie.formats.draft import load_draft as load_exported

    path = Path(path)
    if not (path / "config.json").is_file():
        raise EvaluateError(f"{path}/config.json: not found; run `eyrie export` first")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            draft = load_exported(path)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise EvaluateError(
            f"{path}: speculators cannot load the draft ({first}); re-export it "
            "(its verifier.name_or_path must point at the target folder)"
        ) from exc
    for name, tensor in draft.state_dict().items():
        if name.startswith("verifier_"):
            continue  # training-only weights, unused at inference
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise EvaluateError(
                f"{path}: draft tensor {name!r} has non-finite values; re-export "
                "the draft from a finished training run"
            )
    return draft


def check_draft(
    draft, path, aux_ids: list[int], hidden_size: int, vocab_map: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """The draft must read the aux layers the preflight chose and use this vocabulary map
    (`vocab_map`: d2t, t2d)."""
    d2t, t2d = vocab_map
    draft_aux = list(draft.config.eagle_aux_hidden_state_layer_ids)
    if draft_aux != list(aux_ids):
        raise EvaluateError(
            f"{path}: draft eagle_aux_hidden_state_layer_ids {draft_aux} differ "
            f"from the preflight's aux_layer_ids {list(aux_ids)}; retrain/export "
            "the draft with the preflight's layers (or rerun preflight)"
        )
    if draft.hidden_size != hidden_size:
        raise EvaluateError(
            f"{path}: draft hidden size {draft.hidden_size} but the target's is "
            f"{hidden_size}; train the draft for this target"
        )
    if draft.draft_vocab_size != len(d2t):
        raise EvaluateError(
            f"{path}: draft_vocab_size {draft.draft_vocab_size} but the vocabulary "
            f"map has {len(d2t)} entries; use the draft trained with this map"
        )
    if draft.d2t is not None and not (
        torch.equal(draft.d2t.cpu(), d2t) and torch.equal(draft.t2d.cpu(), t2d)
    ):
        raise EvaluateError(
            f"{path}: the draft's d2t/t2d differ from the vocabulary map's; use "
            "the draft trained with this map"
        )


def plot(path: str | Path, report: dict) -> None:
    """eval.png: per-position acceptance of both drafts (left) and the trained draft's acceptance
    length at every K' <= K (right); the title names the engine and dtype of the figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def fmt(al):
        return "n/a" if al is None else f"{al:.3f}"

    K, trained, untrained, engine = (
        report["K"],
        report["trained"],
        report["untrained"],
        report["engine"],
    )
    positions = list(range(1, K + 1))
    width = 0.4
    fig, (ax, ax_k) = plt.subplots(1, 2, figsize=(max(4.0, 1.2 * K + 2) + 4, 3.5))
    for offset, (label, m) in zip(
        (-width / 2, width / 2), (("trained", trained), ("untrained", untrained))
    ):
        values = m["per_position_acceptance"] or [0.0] * K
        label = f"{label} (AL {fmt(m['acceptance_length'])})"
        ax.bar([p + offset for p in positions], values, width, label=label)
    ax.set_xticks(positions)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.legend()
    by_k = [float("nan") if al is None else al for al in trained["acceptance_length_by_k"]]
    ax_k.plot(positions, by_k, marker="o", label="trained")
    ax_k.set_xticks(positions)
    ax_k.set_xlabel("K (draft tokens per verification)")
    ax_k.set_ylabel("acceptance length")
    ax_k.legend()
    fig.suptitle(
        f"K={K}: AL trained {fmt(trained['acceptance_length'])} vs untrained "
        f"{fmt(untrained['acceptance_length'])} ({engine['name']}, {engine['dtype']})"
    )
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
        if tmp.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
            raise EvaluateError(f"{path}: matplotlib did not write a PNG")
    plt.close(fig)


@dataclass(frozen=True)
class EvalPaths:
    """The stage's files, as given on the command line (written into the report as given)."""

    target: str | Path
    draft: str | Path  # exported draft folder
    vocab: str | Path  # vocab.safetensors (d2t, t2d)
    eval_set: str | Path  # eval.parquet with prompt_ids
    preflight: str | Path  # preflight.json
    out: str | Path  # eval.json to write
    plot: str | Path  # eval.png to write


@dataclass(frozen=True)
class EvalInputs:
    """The checked inputs: the preflight's aux ids, the vocabulary map, the prompts, the draft."""

    aux_ids: list[int]
    d2t: torch.Tensor
    t2d: torch.Tensor
    prompts: list  # (sample_id, prompt ids)
    draft: object  # speculators' Eagle3DraftModel


def check_inputs(paths: EvalPaths, cfg: EvalSettings) -> EvalInputs:
    """Every input checked against the target before any model is loaded."""
    from eyrie.arch.target import inspect_target
    from eyrie.core.errors import TargetError

    try:
        info = inspect_target(paths.target)
    except TargetError as exc:
        raise EvaluateError(str(exc)) from exc
    aux_ids = read_preflight(paths.preflight, info.fingerprint, info.num_hidden_layers)
    d2t, t2d = read_vocab(paths.vocab, info.vocab_size)
    prompts = read_prompts(paths.eval_set, cfg.num_prompts, info.vocab_size)
    if draft_is_rehearsal(paths.draft):
        raise EvaluateError(
            refusal(
                Path(paths.draft) / "provenance.json",
                "a draft",
                "evaluate the draft of the run without vllm.rehearsal (results/<name>/draft); a "
                "rehearsal has no Hugging Face evaluation",
            )
        )
    draft = load_draft(paths.draft)
    check_draft(draft, paths.draft, aux_ids, info.hidden_size, (d2t, t2d))
    verifier = draft.config.speculators_config.verifier.name_or_path
    if verifier and Path(verifier).resolve() != Path(paths.target).resolve():
        log.warning(
            "draft's verifier.name_or_path is %s, evaluating against %s", verifier, paths.target
        )
    max_pos = info.text_config.get("max_position_embeddings")
    longest = max(len(p) for _, p in prompts) + cfg.max_new_tokens + cfg.K
    if isinstance(max_pos, int) and longest > max_pos:
        raise EvaluateError(
            f"{paths.eval_set}: longest prompt + eval.max_new_tokens + K = {longest} "
            f"exceeds the target's max_position_embeddings {max_pos}; lower "
            "eval.max_new_tokens"
        )
    return EvalInputs(aux_ids, d2t, t2d, prompts, draft)


def load_target(target: str | Path, device: str, dtype: str):
    """(the target in `dtype` on `device`, its tokenizer's eos id or None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        log.warning("the tokenizer has no eos token: decoding stops at max_new_tokens only")
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=getattr(torch, dtype))
    return model.to(device).eval(), eos_id


def build_proposers(target: str | Path, inputs: EvalInputs, device: str, dtype: str) -> dict:
    """{"trained": the exported draft, "untrained": a fresh draft of the same shape (the
    baseline, seeded with UNTRAINED_SEED)} as EAGLE-3 proposers on `device` in `dtype` (the
    target's, as vLLM runs a draft)."""
    from eyrie.arch.draft import DraftSpec, build_draft

    draft = inputs.draft
    tl = draft.config.transformer_layer_config
    spec = DraftSpec(
        inputs.aux_ids,
        num_layers=tl.num_hidden_layers,
        draft_arch=tl.model_type,
        norm_before_residual=draft.config.norm_before_residual,
        norm_before_fc=draft.config.norm_before_fc,
    )
    untrained = build_draft(target, spec, inputs.d2t, inputs.t2d, seed=UNTRAINED_SEED)
    return {
        "trained": Eagle3Proposer(draft.to(device, getattr(torch, dtype))),
        "untrained": Eagle3Proposer(untrained.to(device, getattr(torch, dtype))),
    }


@dataclass
class Decoder:
    """The target and the proposers: decodes one prompt greedily and speculatively with each,
    counting into `stats` (one SpecStats per proposer), and with the trained draft again at every
    K' < K, counting into `stats_at_k[K']`.

    Each K' is decoded for real, not derived from the K run: a draft chain's first K' tokens do
    not depend on K, but the positions it drafts from do (at K' the next draft starts after at
    most K' + 1 new tokens), so min(accepted at K, K') per step is not the acceptance at K'.
    """

    model: object
    proposers: dict
    decoding: Decoding
    stats: dict = field(init=False)
    stats_at_k: dict = field(init=False)
    # in 16 bits: {run label: prompts whose speculative output differed from greedy decoding}
    differs: dict = field(init=False)

    def __post_init__(self):
        self.differs = {}
        self.stats = {name: SpecStats(self.decoding.K) for name in self.proposers}
        self.stats_at_k = {k: SpecStats(k) for k in range(1, self.decoding.K)}

    def runs(self):
        """(label, proposer, decoding, stats) of every speculative run of one prompt."""
        d = self.decoding
        for name, propose in self.proposers.items():
            yield f"{name} draft", propose, d, self.stats[name]
        for k, stats in self.stats_at_k.items():
            yield f"trained draft at K={k}", self.proposers["trained"], replace(d, K=k), stats

    def acceptance_length_by_k(self) -> list:
        """The trained draft's acceptance length at K' = 1..K (index K' - 1)."""
        at = [self.stats_at_k[k] for k in range(1, self.decoding.K)] + [self.stats["trained"]]
        return [s.metrics()["acceptance_length"] for s in at]

    def decode(self, sample_id: str, prompt_ids: list[int], where) -> list[int]:
        """The target's greedy output; each speculative output must equal it in float32 (else
        an error: a bug), and is counted in `differs` where it does not in 16 bits."""
        d = self.decoding
        reference = greedy_generate(self.model, prompt_ids, d.max_new_tokens, d.eos_id)
        for name, propose, decoding, stats in self.runs():
            got = speculative_generate(self.model, prompt_ids, propose, decoding, stats=stats)
            if got != reference:
                at = next(
                    (i for i, (a, b) in enumerate(zip(got, reference)) if a != b),
                    min(len(got), len(reference)),
                )
                message = (
                    f"{where}: prompt {sample_id}: speculative output with the {name} "
                    f"differs from the target's greedy output at new token {at} ({len(got)} vs "
                    f"{len(reference)} tokens)"
                )
                if self.model.dtype == torch.float32:
                    raise EvaluateError(
                        f"{message}; speculative decoding must not change greedy outputs"
                    )
                # in 16 bits a forward over L + K tokens may round a near tie differently from one
                # over L, as vLLM's may: counted and reported, the acceptance stays well defined
                log.warning(
                    "%s: in %s a near tie can round either way (eval.dtype: float32 tells "
                    "rounding from a bug)",
                    message,
                    str(self.model.dtype).removeprefix("torch."),
                )
                self.differs.setdefault(name, []).append(sample_id)
        return reference


def decode_prompts(decoder: Decoder, prompts: list, where) -> int:
    """Decode every prompt (a log line each); returns the number of output tokens."""
    output_tokens = 0
    for n, (sample_id, prompt_ids) in enumerate(prompts, 1):
        reference = decoder.decode(sample_id, prompt_ids, where)
        output_tokens += len(reference)
        log.info(
            "prompt %d/%d (%s): %d prompt + %d new tokens; AL so far trained %.3f, untrained %.3f",
            n,
            len(prompts),
            sample_id,
            len(prompt_ids),
            len(reference),
            *(
                decoder.stats[k].metrics()["acceptance_length"] or 1.0
                for k in ("trained", "untrained")
            ),
        )
    return output_tokens


def evaluate(paths: EvalPaths, settings: dict) -> dict:
    """Run the evaluation and write eval.json and eval.png; returns the report."""
    cfg = parse_settings(settings)
    inputs = check_inputs(paths, cfg)
    model, eos_id = load_target(paths.target, cfg.device, cfg.dtype)
    proposers = build_proposers(paths.target, inputs, cfg.device, cfg.dtype)
    decoder = Decoder(model, proposers, Decoding(cfg.K, cfg.max_new_tokens, eos_id, inputs.aux_ids))
    log.info(
        "evaluating %s on %d prompts: K=%d, max_new_tokens=%d, aux ids %s, device %s, %s",
        paths.draft,
        len(inputs.prompts),
        cfg.K,
        cfg.max_new_tokens,
        inputs.aux_ids,
        cfg.device,
        cfg.dtype,
    )
    output_tokens = decode_prompts(decoder, inputs.prompts, paths.eval_set)
    report = {
        "K": cfg.K,
        "num_prompts": len(inputs.prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "output_tokens": output_tokens,
        "engine": {"name": "hf", "dtype": cfg.dtype, "device": cfg.device},
        "trained": {
            **decoder.stats["trained"].metrics(),
            "acceptance_length_by_k": decoder.acceptance_length_by_k(),
        },
        "untrained": decoder.stats["untrained"].metrics(),
        "outputs_match_target_greedy": not decoder.differs,
        # in 16 bits only (float32 refuses a difference): {run: prompts whose output differed}
        "outputs_differing_from_greedy": decoder.differs,
        "aux_layer_ids": inputs.aux_ids,
        "eos_token_id": eos_id,
        "draft": str(paths.draft),
        "target": str(paths.target),
        "untrained_seed": UNTRAINED_SEED,
        "provenance": provenance(settings),
    }
    plot(paths.plot, report)
    write_json(paths.out, report)
    keep_last_good(paths.out)
    log.info(
        "acceptance length: trained %s, untrained %s -> %s",
        report["trained"]["acceptance_length"],
        report["untrained"]["acceptance_length"],
        paths.out,
    )
    return report


def add_arguments(parser) -> None:
    from eyrie.core.runtime import settings_arg

    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--draft", required=True, help="exported draft folder (speculators format)")
    parser.add_argument("--vocab", required=True, help="vocab.safetensors (d2t, t2d)")
    parser.add_argument("--eval-set", required=True, help="eval.parquet with prompt_ids")
    parser.add_argument("--preflight", required=True, help="preflight.json")
    parser.add_argument("--out", required=True, help="eval.json to write")
    parser.add_argument("--plot", required=True, help="eval.png to write")
    parser.add_argument(
        "--settings", required=True, type=settings_arg, help="JSON object with the eval settings"
    )


def run(args) -> int:
    paths = EvalPaths(
        args.target, args.draft, args.vocab, args.eval_set, args.preflight, args.out, args.plot
    )
    evaluate(paths, args.settings)
    return 0

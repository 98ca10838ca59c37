"""evaluate-vllm, step 1 (check): everything that needs no GPU, before any engine starts.

The settings (eval and vllm, typed), the exported draft's config.json against what vLLM would
serve and against the target, the rehearsal's rules, the installed vLLM, the Hugging Face
evaluation it is compared with, the prompts and the context length. The result is a VllmPlan,
which the run, compare and report steps read. docs/vllm.md (Evaluation through vLLM).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from eyrie.arch.methods import BLOCK_METHODS, DRAFT_METHODS, aux_key
from eyrie.arch.target import inspect_target
from eyrie.config.drafts import block_positions
from eyrie.config.stages import VllmEvalSettings
from eyrie.core.errors import EvaluateError, TargetError
from eyrie.core.rehearsal import draft_is_rehearsal, refuse_in_real_run
from eyrie.formats.draft import DRAFT_ARCHS, UNSERVABLE_FLAGS
from eyrie.formats.tokenized import read_prompts

log = logging.getLogger(__name__)


def _posint(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read_draft_config(draft_dir: Path) -> dict:
    """The exported draft's config.json as a JSON object."""
    path = draft_dir / "config.json"
    if not path.is_file():
        raise EvaluateError(f"{path}: not found; pass an exported draft folder (`eyrie export`)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EvaluateError(f"{path}: not valid JSON ({exc}); re-export the draft") from exc
    if not isinstance(config, dict):
        raise EvaluateError(f"{path}: not a JSON object; re-export the draft")
    return config


def format_problems(config: dict) -> list[str]:
    """What vLLM would serve differently from the trained draft: the method, flags, layer type."""
    problems = []
    method = config.get("speculators_model_type")
    if method not in DRAFT_METHODS:
        problems.append(
            f"speculators_model_type is {method!r}, not one of {', '.join(DRAFT_METHODS)}; "
            "re-export the draft with eyrie export"
        )
    for flag, reason in UNSERVABLE_FLAGS.items():
        if config.get(flag):
            problems.append(
                f"{flag} is true, but {reason}: the served network would differ from "
                f"the trained one; retrain with {flag} off"
            )
    layer = config.get("transformer_layer_config") or {}
    if layer.get("model_type") not in DRAFT_ARCHS:
        problems.append(
            f"transformer_layer_config.model_type {layer.get('model_type')!r}; vLLM "
            f"serves drafts of type {', '.join(DRAFT_ARCHS)}"
        )
    return problems


def target_problems(config: dict, info) -> list[str]:
    """Shapes and layer ids that belong to another target than `info`."""
    problems = []
    layer = config.get("transformer_layer_config") or {}
    hidden = config.get("target_hidden_size") or layer.get("hidden_size")
    if hidden != info.hidden_size:
        problems.append(
            f"target_hidden_size {hidden!r} but the target's hidden_size is "
            f"{info.hidden_size}; use a draft trained for this target"
        )
    if layer.get("vocab_size") != info.vocab_size:
        problems.append(
            f"transformer_layer_config.vocab_size {layer.get('vocab_size')!r} but the "
            f"target's vocab_size is {info.vocab_size}; use a draft trained for this target"
        )
    draft_vocab = config.get("draft_vocab_size")
    if not _posint(draft_vocab) or draft_vocab > info.vocab_size:
        problems.append(
            f"draft_vocab_size {draft_vocab!r} must be an integer within "
            f"1..{info.vocab_size}; re-export the draft"
        )
    key = aux_key(config.get("speculators_model_type"))
    aux = config.get(key)
    N = info.num_hidden_layers
    if not (isinstance(aux, list) and aux and all(isinstance(i, int) and 0 <= i < N for i in aux)):
        problems.append(
            f"{key} {aux!r} must be a non-empty list of "
            f"layer ids within 0..{N - 1} (the target has {N} layers)"
        )
    return problems


def block_width_problems(config: dict, K: int) -> list[str]:
    """K past the tokens a block drafter's block proposes (eyrie.config.drafts.block_positions):
    both evaluations refuse it (`config`: the exported draft's config.json)."""
    method = config.get("speculators_model_type")
    if method not in BLOCK_METHODS:
        return []
    most = block_positions(method, config.get("block_size"), config.get("sample_from_anchor"))
    if K <= most:
        return []
    return [
        f"eval.num_speculative_tokens {K} but this {method} draft proposes {most} tokens per "
        f"block (block_size {config.get('block_size')}); set it to at most {most}"
    ]


def check_draft_config(draft_dir: str | Path, info) -> dict:
    """Refuse, from config.json alone, a draft vLLM would not serve as trained (all problems at
    once): no draft kind eyrie trains, flags vLLM 0.22 ignores (fc_norm, norm_output), another
    target's shapes, aux layers outside the target, no weights. Returns the config."""
    draft_dir = Path(draft_dir)
    config = read_draft_config(draft_dir)
    problems = format_problems(config) + target_problems(config, info)
    if not any(draft_dir.glob("*.safetensors")):
        problems.append("no *.safetensors weights beside it; re-export the draft")
    if problems:
        raise EvaluateError(
            f"{draft_dir / 'config.json'}: vLLM would not serve this draft as trained: "
            + "; ".join(problems)
        )
    return config


def read_hf_eval(path: str | Path, K: int, max_new_tokens: int) -> dict:
    """The Hugging Face evaluation (eyrie evaluate's eval.json), checked to have used the same K
    and max_new_tokens: {acceptance_length, per_position_acceptance, num_prompts, eos_token_id,
    draft, path, engine (its name and dtype; null in an eval.json from before they were
    recorded), sampled (its sampled run at eval.temperature, or None)}."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EvaluateError(f"{path}: unreadable ({exc}); run `eyrie evaluate` first") from exc
    trained = report.get("trained") if isinstance(report, dict) else None
    missing = [
        k
        for k in ("K", "max_new_tokens", "num_prompts", "eos_token_id", "trained")
        if not isinstance(report, dict) or k not in report
    ]
    if missing or not isinstance(trained, dict) or "acceptance_length" not in trained:
        raise EvaluateError(
            f"{path}: keys {missing or ['trained.acceptance_length']} missing; "
            "rerun `eyrie evaluate`"
        )
    stale = [
        f"{key} {report[key]} (here {want})"
        for key, want in (("K", K), ("max_new_tokens", max_new_tokens))
        if report[key] != want
    ]
    if stale:
        raise EvaluateError(
            f"{path}: evaluated with {', '.join(stale)}; rerun `eyrie evaluate` "
            "with the same eval settings so the two AL are comparable"
        )
    return {
        "acceptance_length": trained["acceptance_length"],
        "per_position_acceptance": trained.get("per_position_acceptance"),
        "num_prompts": report["num_prompts"],
        "eos_token_id": report["eos_token_id"],
        "draft": report.get("draft"),
        "path": str(path),
        "engine": report.get("engine"),
        "sampled": report.get("sampled"),  # eval.temperature > 0: its sampled run, else None
    }


def check_installed_vllm(target: str | Path, draft_dir: str | Path, draft: dict) -> None:
    """Preflight's vLLM checks that serving needs, repeated in the job's first seconds: eval.vllm
    and the vLLM environment are not compared settings (switching them reruns no preflight);
    and for a block drafter, that this vLLM serves it as trained (`draft`: its config.json)."""
    from eyrie.vllm.checks import block_draft_problems, version_problems
    from eyrie.vllm.facts import gather_facts

    config = json.loads((Path(target) / "config.json").read_text())
    facts = gather_facts(config)
    problems = version_problems(facts)
    method = draft.get("speculators_model_type")
    if method in BLOCK_METHODS:
        where = str(Path(draft_dir) / "config.json")
        problems += block_draft_problems(method, facts, draft, where)
    if not facts.eagle3_target:
        problems.append(
            f"vLLM {facts.version}: {facts.architecture_class or facts.architecture} "
            "cannot be an EAGLE-3 target (no set_aux_hidden_state_layers); serve "
            "another vLLM or evaluate with the Hugging Face loop only"
        )
    if problems:
        raise EvaluateError(f"{target}: " + "; ".join(problems))


@dataclass(frozen=True)
class VllmEvalPaths:
    """The stage's files, as given on the command line (written into the report as given)."""

    target: str | Path
    draft: str | Path  # exported draft folder
    eval_set: str | Path  # eval.parquet with prompt_ids
    hf_eval: str | Path | None  # eval.json of `eyrie evaluate`; None only in a rehearsal
    out: str | Path  # eval_vllm.json to write


@dataclass(frozen=True)
class VllmPlan:
    """What the CPU checks established before any engine starts."""

    paths: VllmEvalPaths
    cfg: VllmEvalSettings
    settings: dict
    draft_config: dict
    hf: dict | None  # read_hf_eval's dict; None in a rehearsal without --hf-eval
    prompts: list  # (sample_id, prompt ids)
    max_model_len: int

    @property
    def hf_sampled(self) -> dict | None:
        """The HF evaluation's sampled run (eval.json "sampled"), if it sampled."""
        return self.hf.get("sampled") if self.hf else None

    @property
    def eos_token_id(self) -> int | None:
        """The stop token: the HF evaluation's; none in a rehearsal without it (every prompt
        decodes eval.max_new_tokens)."""
        return self.hf["eos_token_id"] if self.hf else None


def check_hf_prompts(paths: VllmEvalPaths, hf: dict, prompts: list) -> None:
    """The HF evaluation must have decoded these prompts; a different draft is only warned of."""
    if hf["num_prompts"] != len(prompts):
        raise EvaluateError(
            f"{paths.hf_eval}: evaluated {hf['num_prompts']} prompts, here "
            f"{len(prompts)} from {paths.eval_set}; rerun `eyrie evaluate` on this set"
        )
    if hf["draft"] and Path(hf["draft"]).resolve() != Path(paths.draft).resolve():
        log.warning(
            "%s evaluated the draft %s; this run serves %s", paths.hf_eval, hf["draft"], paths.draft
        )


def resolve_max_model_len(cfg: VllmEvalSettings, info, prompts: list, eval_set) -> int:
    """vllm.max_model_len, or (null) the longest prompt + max_new_tokens + K; within the target."""
    need = max(len(ids) for _, ids in prompts) + cfg.max_new_tokens + cfg.K
    asked = cfg.vllm.max_model_len
    max_pos = info.text_config.get("max_position_embeddings")
    if asked is not None and asked < need:
        raise EvaluateError(
            f"vllm.max_model_len={asked} is below the longest prompt + "
            f"eval.max_new_tokens + K = {need}; raise it (or null: {need})"
        )
    max_model_len = asked or need
    if isinstance(max_pos, int) and max_model_len > max_pos:
        raise EvaluateError(
            f"{eval_set}: max_model_len {max_model_len} (longest prompt + "
            f"eval.max_new_tokens + K = {need}) exceeds the target's "
            f"max_position_embeddings {max_pos}; lower eval.max_new_tokens"
        )
    return max_model_len


def check_rehearsal(paths: VllmEvalPaths, rehearsal: bool) -> None:
    """A real evaluation needs the HF evaluation and refuses a rehearsal's draft."""
    if rehearsal:
        return
    if paths.hf_eval is None:
        raise EvaluateError(
            "--hf-eval: missing; pass the eval.json of `eyrie evaluate` (only a rehearsal, "
            "vllm.rehearsal: true, runs without it)"
        )
    found = Path(paths.draft) / "provenance.json" if draft_is_rehearsal(paths.draft) else None
    refuse_in_real_run(found, "a draft", "evaluate the draft", "draft", "evaluation", EvaluateError)


def plan_evaluation(paths: VllmEvalPaths, settings: dict, runtime: dict | None = None) -> VllmPlan:
    """Every check that needs no GPU, in the order a user fixes them."""
    cfg = VllmEvalSettings.from_settings(settings, runtime)
    try:
        info = inspect_target(paths.target)
    except TargetError as exc:
        raise EvaluateError(str(exc)) from exc
    draft_config = check_draft_config(paths.draft, info)
    width = block_width_problems(draft_config, cfg.K)
    if width:
        raise EvaluateError(f"{Path(paths.draft) / 'config.json'}: " + "; ".join(width))
    check_rehearsal(paths, cfg.rehearsal)
    check_installed_vllm(paths.target, paths.draft, draft_config)
    hf = None if paths.hf_eval is None else read_hf_eval(paths.hf_eval, cfg.K, cfg.max_new_tokens)
    prompts = read_prompts(paths.eval_set, cfg.num_prompts, info.vocab_size)
    if hf is not None:
        check_hf_prompts(paths, hf, prompts)
    max_model_len = resolve_max_model_len(cfg, info, prompts, paths.eval_set)
    return VllmPlan(paths, cfg, settings, draft_config, hf, prompts, max_model_len)

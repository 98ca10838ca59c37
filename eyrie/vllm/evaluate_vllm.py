"""Acceptance length of an exported draft measured by vLLM itself, from vLLM's own counters.

The evaluate-vllm stage, the real client of our exports: it serves the target with the exported
EAGLE-3 draft through vLLM (`speculative_config={"model": DRAFT, "method": "eagle3", ...}`),
greedily decodes the held-out prompts, and reads acceptance from vLLM's spec-decode counters
(AL = 1 + accepted / num_drafts; per position accepted_per_pos[k] / num_drafts). The same prompts
are decoded without speculation in the same execution mode, and every speculative output must
equal that baseline token for token. The Hugging Face evaluation's AL (eyrie.evaluate) is put
beside vLLM's.

Everything that needs no GPU is checked first: the settings (all at once), the target, the
draft's config.json (flags vLLM 0.22 ignores are refused), the HF evaluation and the prompts.
Runs in the vLLM environment (.venv-vllm): imports vllm, torch, pyarrow and eyrie, never
speculators or matplotlib.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from eyrie.arch.target import inspect_target
from eyrie.errors import EvaluateError, TargetError
from eyrie.evaluate.specdec import SpecStats
from eyrie.formats.draft import DRAFT_ARCHS, UNSERVABLE_FLAGS
from eyrie.formats.tokenized import read_prompts
from eyrie.io import provenance, write_json

log = logging.getLogger(__name__)


NUM_DRAFTS = "vllm:spec_decode_num_drafts"


NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"


NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


DEFAULT_GPU_MEMORY_UTILIZATION = 0.85  # config/schema.yaml's vllm.gpu_memory_utilization default


VLLM_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class VllmEvalSettings:
    K: int
    max_new_tokens: int
    num_prompts: int
    tensor_parallel_size: int
    gpu_memory_utilization: float
    enforce_eager: bool
    max_model_len: int | None  # None: longest prompt + max_new_tokens + K
    dtype: str = "auto"  # vLLM's dtype; auto: vLLM's choice (bfloat16 for a float32 checkpoint)


def _posint(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def parse_settings(settings: dict, gpu_memory_utilization: float | None = None) -> VllmEvalSettings:
    """Check the eval and vllm settings (every problem at once, each naming its key).

    `gpu_memory_utilization` (the CLI flag) replaces vllm.gpu_memory_utilization: it changes no
    result, so the workflow keeps it out of --settings (no rerun when it changes).
    """
    problems = []
    sections = {}
    for name in ("eval", "vllm"):
        section = settings.get(name)
        if not isinstance(section, dict):
            problems.append(
                f"key {name!r} missing or not an object; pass the config's {name} section"
            )
        sections[name] = section if isinstance(section, dict) else None
    ev, vl = sections["eval"] or {}, sections["vllm"] or {}
    if sections["eval"] is not None:
        for key in ("num_speculative_tokens", "max_new_tokens", "num_prompts"):
            if not _posint(ev.get(key)):
                problems.append(f"eval.{key}={ev.get(key)!r} must be an integer >= 1")
    if sections["vllm"] is not None:
        if not _posint(vl.get("tensor_parallel_size", 1)):
            problems.append(
                f"vllm.tensor_parallel_size={vl.get('tensor_parallel_size')!r} must be "
                "an integer >= 1"
            )
        if not isinstance(vl.get("enforce_eager", True), bool):
            problems.append(f"vllm.enforce_eager={vl.get('enforce_eager')!r} must be true or false")
        if vl.get("dtype", "auto") not in VLLM_DTYPES:
            problems.append(
                f"vllm.dtype={vl.get('dtype')!r} must be one of {', '.join(VLLM_DTYPES)}"
            )
        if vl.get("max_model_len") is not None and not _posint(vl.get("max_model_len")):
            problems.append(
                f"vllm.max_model_len={vl.get('max_model_len')!r} must be null or an integer >= 1"
            )
    gpu_key = (
        "--gpu-memory-utilization"
        if gpu_memory_utilization is not None
        else "vllm.gpu_memory_utilization"
    )
    gpu = (
        gpu_memory_utilization
        if gpu_memory_utilization is not None
        else vl.get("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION)
    )
    if isinstance(gpu, bool) or not isinstance(gpu, (int, float)) or not 0 < gpu <= 1:
        problems.append(f"{gpu_key}={gpu!r} must be a number in (0, 1]")
    if problems:
        raise EvaluateError("invalid --settings: " + "; ".join(problems))
    return VllmEvalSettings(
        ev["num_speculative_tokens"],
        ev["max_new_tokens"],
        ev["num_prompts"],
        vl.get("tensor_parallel_size", 1),
        float(gpu),
        vl.get("enforce_eager", True),
        vl.get("max_model_len"),
        vl.get("dtype", "auto"),
    )


def check_draft_config(draft_dir: str | Path, info) -> dict:
    """Refuse, from config.json alone, a draft vLLM would not serve as trained (all problems at
    once): not EAGLE-3, flags vLLM 0.22 ignores (fc_norm, norm_output), another target's shapes,
    aux layers outside the target, no weights. Returns the config."""
    draft_dir = Path(draft_dir)
    path = draft_dir / "config.json"
    if not path.is_file():
        raise EvaluateError(f"{path}: not found; pass an exported draft folder (`eyrie export`)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EvaluateError(f"{path}: not valid JSON ({exc}); re-export the draft") from exc
    if not isinstance(config, dict):
        raise EvaluateError(f"{path}: not a JSON object; re-export the draft")
    problems = []
    if config.get("speculators_model_type") != "eagle3":
        problems.append(
            f"speculators_model_type is {config.get('speculators_model_type')!r}, not "
            "'eagle3'; this stage serves EAGLE-3 drafts only"
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
            f"serves EAGLE-3 drafts of type {', '.join(DRAFT_ARCHS)}"
        )
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
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    N = info.num_hidden_layers
    if not (isinstance(aux, list) and aux and all(isinstance(i, int) and 0 <= i < N for i in aux)):
        problems.append(
            f"eagle_aux_hidden_state_layer_ids {aux!r} must be a non-empty list of "
            f"layer ids within 0..{N - 1} (the target has {N} layers)"
        )
    if not any(draft_dir.glob("*.safetensors")):
        problems.append("no *.safetensors weights beside it; re-export the draft")
    if problems:
        raise EvaluateError(
            f"{path}: vLLM would not serve this draft as trained: " + "; ".join(problems)
        )
    return config


def read_hf_eval(path: str | Path, K: int, max_new_tokens: int) -> dict:
    """The Hugging Face evaluation (eyrie evaluate's eval.json), checked to have used the same K
    and max_new_tokens: {acceptance_length, per_position_acceptance, num_prompts, eos_token_id,
    draft, path}."""
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
    }


def spec_counters(metrics: list, K: int) -> dict:
    """AL and per-position acceptance from `LLM.get_metrics()` (vllm.v1.metrics.reader objects).

    Counters are summed over label sets (one per engine). Returns SpecStats.metrics()'s dict:
    acceptance_length = 1 + accepted_tokens / num_drafts (None without drafts),
    per_position_acceptance[k] = accepted_at_position[k] / num_drafts, and the raw counts.
    """
    from vllm.v1.metrics.reader import Counter, Vector

    totals = {NUM_DRAFTS: 0, NUM_DRAFT_TOKENS: 0, NUM_ACCEPTED: 0}
    per_pos = [0] * K
    seen = set()
    for metric in metrics:
        if isinstance(metric, Counter) and metric.name in totals:
            totals[metric.name] += int(metric.value)
            seen.add(metric.name)
        elif isinstance(metric, Vector) and metric.name == ACCEPTED_PER_POS:
            if len(metric.values) != K:
                raise EvaluateError(
                    f"vLLM reported {ACCEPTED_PER_POS} for {len(metric.values)} "
                    f"positions, expected K={K}; the engine ran another K"
                )
            per_pos = [a + int(b) for a, b in zip(per_pos, metric.values)]
            seen.add(metric.name)
    missing = sorted({*totals, ACCEPTED_PER_POS} - seen)
    if missing:
        raise EvaluateError(
            f"vLLM reported no {', '.join(missing)}; the engine must run with "
            "a speculative_config and disable_log_stats=False"
        )
    if sum(per_pos) != totals[NUM_ACCEPTED]:
        raise EvaluateError(
            f"vLLM's counters disagree: {ACCEPTED_PER_POS} sums to {sum(per_pos)} "
            f"but {NUM_ACCEPTED} is {totals[NUM_ACCEPTED]}"
        )
    return SpecStats(
        K,
        num_drafts=totals[NUM_DRAFTS],
        num_draft_tokens=totals[NUM_DRAFT_TOKENS],
        accepted_tokens=totals[NUM_ACCEPTED],
        accepted_at_position=per_pos,
    ).metrics()


def run_engine(name: str, request: dict, workdir: Path) -> dict:
    """One vLLM engine run (`request`: engine kwargs, prompts, sampling) in its own process.

    Each of the two runs (baseline, speculative) gets a fresh Python process rather than two LLM
    instances in this one: process exit releases GPU memory, vLLM's engine-core and worker
    processes and NCCL state on every vLLM version, whereas deleting an LLM and emptying the CUDA
    cache has leaked memory in some releases; and vLLM's Prometheus registry, which get_metrics()
    reads, is process-global, so in a fresh process the speculative run's counters start at zero.
    """
    req_path, res_path = workdir / f"{name}.request.json", workdir / f"{name}.result.json"
    req_path.write_text(json.dumps(request))
    env = dict(os.environ)
    # greedy sampling never uses FlashInfer's top-k/top-p sampler; offline installs lack it
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    log.info("vLLM %s run: %d prompts (%s)", name, len(request["prompts"]), sys.executable)
    proc = subprocess.run(
        [sys.executable, "-m", "eyrie.vllm.evaluate_vllm", str(req_path), str(res_path)], env=env
    )
    if proc.returncode != 0 or not res_path.is_file():
        raise EvaluateError(
            f"the vLLM {name} run failed (exit {proc.returncode}); its error and "
            "traceback are in the log above"
        )
    result = json.loads(res_path.read_text())
    if len(result["outputs"]) != len(request["prompts"]):
        raise EvaluateError(
            f"the vLLM {name} run returned {len(result['outputs'])} outputs for "
            f"{len(request['prompts'])} prompts"
        )
    return result


def _generate(request: dict) -> dict:
    """Worker side: build the engine, decode every prompt greedily, read the counters."""
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(**request["engine"], speculative_config=request["speculative_config"])
    eos = request["eos_token_id"]
    # The HF loop's stopping rule (eyrie.evaluate.specdec): the tokenizer's eos only, or max_new_tokens.
    # ignore_eos keeps vLLM from adding generation_config's other eos ids as stop tokens.
    params = SamplingParams(
        temperature=0.0,
        max_tokens=request["max_new_tokens"],
        ignore_eos=True,
        stop_token_ids=[eos] if eos is not None else None,
        detokenize=False,
    )
    prompts = request["prompts"]
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    # wall time includes the first call's kernel compilation (Triton JIT): a log line, no metric
    log.info("generate: %d prompts in %.2f s", len(prompts), time.perf_counter() - start)
    for ids, res in zip(prompts, results, strict=True):
        if list(res.prompt_token_ids) != ids:
            raise RuntimeError("vLLM returned outputs in another order than the prompts")
    spec = request["speculative_config"]
    return {
        "vllm_version": vllm.__version__,
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        "outputs": [list(res.outputs[0].token_ids) for res in results],
        "counters": spec_counters(llm.get_metrics(), spec["num_speculative_tokens"])
        if spec
        else None,
    }


def _worker(request_path: str, result_path: str) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        result = _generate(json.loads(Path(request_path).read_text()))
        write_json(result_path, result)
    except Exception:  # noqa: BLE001 - reported with type and traceback; the parent fails
        log.exception("vLLM engine run (%s) failed", request_path)
        return 1
    return 0


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix), or None."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def diagnostic_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(f"{out.stem}.mismatch.json")


def check_installed_vllm(target: str | Path) -> None:
    """Preflight's vLLM checks that serving needs, repeated in the job's first seconds: eval.vllm
    and the vLLM environment are not compared settings (switching them reruns no preflight)."""
    from eyrie.vllm.checks import version_problems
    from eyrie.vllm.facts import gather_facts

    config = json.loads((Path(target) / "config.json").read_text())
    facts = gather_facts(config)
    problems = version_problems(facts)
    if not facts.eagle3_target:
        problems.append(
            f"vLLM {facts.version}: {facts.architecture_class or facts.architecture} "
            "cannot be an EAGLE-3 target (no set_aux_hidden_state_layers); serve "
            "another vLLM or evaluate with the Hugging Face loop only"
        )
    if problems:
        raise EvaluateError(f"{target}: " + "; ".join(problems))


def evaluate_vllm(
    target: str | Path,
    draft_dir: str | Path,
    eval_set: str | Path,
    hf_eval: str | Path,
    out: str | Path,
    settings: dict,
    *,
    gpu_memory_utilization: float | None = None,
) -> dict:
    """Run the evaluation through vLLM and write the report JSON `out`; returns the report."""
    cfg = parse_settings(settings, gpu_memory_utilization)
    try:
        info = inspect_target(target)
    except TargetError as exc:
        raise EvaluateError(str(exc)) from exc
    draft_config = check_draft_config(draft_dir, info)
    check_installed_vllm(target)
    hf = read_hf_eval(hf_eval, cfg.K, cfg.max_new_tokens)
    prompts = read_prompts(eval_set, cfg.num_prompts, info.vocab_size)
    if hf["num_prompts"] != len(prompts):
        raise EvaluateError(
            f"{hf_eval}: evaluated {hf['num_prompts']} prompts, here "
            f"{len(prompts)} from {eval_set}; rerun `eyrie evaluate` on this set"
        )
    if hf["draft"] and Path(hf["draft"]).resolve() != Path(draft_dir).resolve():
        log.warning(
            "%s evaluated the draft %s; this run serves %s", hf_eval, hf["draft"], draft_dir
        )

    need = max(len(ids) for _, ids in prompts) + cfg.max_new_tokens + cfg.K
    max_pos = info.text_config.get("max_position_embeddings")
    if cfg.max_model_len is not None and cfg.max_model_len < need:
        raise EvaluateError(
            f"vllm.max_model_len={cfg.max_model_len} is below the longest prompt + "
            f"eval.max_new_tokens + K = {need}; raise it (or null: {need})"
        )
    max_model_len = cfg.max_model_len or need
    if isinstance(max_pos, int) and max_model_len > max_pos:
        raise EvaluateError(
            f"{eval_set}: max_model_len {max_model_len} (longest prompt + "
            f"eval.max_new_tokens + K = {need}) exceeds the target's "
            f"max_position_embeddings {max_pos}; lower eval.max_new_tokens"
        )

    engine = {
        "model": str(Path(target).resolve()),
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "enforce_eager": cfg.enforce_eager,
        "max_model_len": max_model_len,
        "dtype": cfg.dtype,
        "disable_log_stats": False,  # get_metrics() needs the stat loggers
        # Prompts go as token ids and outputs come back as ids: no tokenizer code runs, so a
        # tokenizer saved by another transformers version than this environment's cannot break it.
        "skip_tokenizer_init": True,
        "seed": 0,
    }
    # The target path is always passed: the draft's verifier.name_or_path may not resolve here.
    speculative = {
        "model": str(Path(draft_dir).resolve()),
        "method": "eagle3",
        "num_speculative_tokens": cfg.K,
    }
    common = {
        "engine": engine,
        "prompts": [ids for _, ids in prompts],
        "max_new_tokens": cfg.max_new_tokens,
        "eos_token_id": hf["eos_token_id"],
    }
    log.info(
        "evaluating %s through vLLM on %d prompts: K=%d, max_new_tokens=%d, eos %s, "
        "enforce_eager=%s, tensor_parallel_size=%d, max_model_len=%d",
        draft_dir,
        len(prompts),
        cfg.K,
        cfg.max_new_tokens,
        hf["eos_token_id"],
        cfg.enforce_eager,
        cfg.tensor_parallel_size,
        max_model_len,
    )
    with tempfile.TemporaryDirectory(prefix="eyrie-eval-vllm-") as tmp:
        base = run_engine("baseline", {**common, "speculative_config": None}, Path(tmp))
        spec = run_engine("speculative", {**common, "speculative_config": speculative}, Path(tmp))

    diagnostic = diagnostic_path(out)
    differ = []
    for (sample_id, _), b, s in zip(prompts, base["outputs"], spec["outputs"]):
        at = first_difference(s, b)
        if at is not None:
            differ.append(
                {"sample_id": sample_id, "first_difference": at, "baseline": b, "speculative": s}
            )
    if differ:
        write_json(
            diagnostic,
            {
                "num_prompts": len(prompts),
                "outputs_differ": len(differ),
                "prompts": differ,
                "counters": spec["counters"],
                "enforce_eager": cfg.enforce_eager,
                "provenance": provenance(settings),
            },
        )
        first = differ[0]
        raise EvaluateError(
            f"{eval_set}: {len(differ)} of {len(prompts)} speculative outputs differ from vLLM's "
            f"greedy outputs without speculation (first: prompt {first['sample_id']} at new token "
            f"{first['first_difference']}); speculative decoding must not change greedy outputs; "
            f"details in {diagnostic}"
        )
    diagnostic.unlink(missing_ok=True)  # a stale one from an earlier failed run

    m = spec["counters"]
    hf_pp, pp = hf["per_position_acceptance"], m["per_position_acceptance"]
    report = {
        "vllm_version": spec["vllm_version"],
        "K": cfg.K,
        "num_prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "outputs_equal": len(prompts),
        "output_tokens": sum(len(o) for o in spec["outputs"]),
        "acceptance_length": m["acceptance_length"],
        "per_position_acceptance": pp,
        "counters": {
            k: m[k]
            for k in ("num_drafts", "num_draft_tokens", "accepted_tokens", "accepted_at_position")
        },
        "hf": {k: hf[k] for k in ("acceptance_length", "per_position_acceptance", "path")},
        "difference": {  # vLLM minus Hugging Face
            "acceptance_length": (
                None
                if None in (m["acceptance_length"], hf["acceptance_length"])
                else m["acceptance_length"] - hf["acceptance_length"]
            ),
            "per_position_acceptance": (
                None
                if pp is None or not isinstance(hf_pp, list) or len(hf_pp) != len(pp)
                else [a - b for a, b in zip(pp, hf_pp)]
            ),
        },
        "eos_token_id": hf["eos_token_id"],
        "engine": {
            "dtype": spec["dtype"],
            "enforce_eager": cfg.enforce_eager,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "max_model_len": max_model_len,
        },
        "draft": str(draft_dir),
        "draft_config": {
            k: draft_config.get(k)
            for k in (
                "eagle_aux_hidden_state_layer_ids",
                "draft_vocab_size",
                "norm_before_residual",
                "norm_before_fc",
            )
        },
        "target": str(target),
        "provenance": provenance(settings),
    }
    write_json(out, report)
    log.info(
        "acceptance length: vLLM %s, Hugging Face %s; %d/%d outputs equal -> %s",
        report["acceptance_length"],
        hf["acceptance_length"],
        len(prompts),
        len(prompts),
        out,
    )
    return report


def add_arguments(parser) -> None:
    from eyrie.runtime import settings_arg

    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--draft", required=True, help="exported draft folder (speculators format)")
    parser.add_argument("--eval-set", required=True, help="eval.parquet with prompt_ids")
    parser.add_argument(
        "--hf-eval",
        required=True,
        help="eval.json of `eyrie evaluate` (its AL "
        "goes beside vLLM's; its eos_token_id is the stop token)",
    )
    parser.add_argument("--out", required=True, help="eval_vllm.json to write")
    parser.add_argument(
        "--settings",
        required=True,
        type=settings_arg,
        help="JSON object with the eval and vllm settings",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="replaces vllm.gpu_memory_utilization (changes no result)",
    )


def run(args) -> int:
    evaluate_vllm(
        args.target,
        args.draft,
        args.eval_set,
        args.hf_eval,
        args.out,
        args.settings,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    return 0


if __name__ == "__main__":  # the engine worker: python -m eyrie.vllm.evaluate_vllm REQUEST RESULT
    sys.exit(_worker(*sys.argv[1:]))

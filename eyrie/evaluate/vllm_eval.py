"""The evaluate-vllm stage: acceptance length of an exported draft, measured by vLLM itself.

It serves the target with the exported EAGLE-3 draft through vLLM and greedily decodes the
held-out prompts twice, without and with speculation, each run in a fresh process; every
speculative output must equal the baseline token for token. AL comes from vLLM's spec-decode
counters (AL = 1 + accepted / num_drafts) and the Hugging Face evaluation's AL goes beside it.
Everything that needs no GPU is checked first. Runs in the vLLM environment: imports vllm, torch,
pyarrow and eyrie, never eyrie.train, speculators or matplotlib. See docs/vllm.md (Evaluation
through vLLM).
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
from eyrie.config.schema import flag_problems, load_settings
from eyrie.core.errors import EvaluateError, TargetError
from eyrie.core.io import keep_last_good, provenance, write_json
from eyrie.core.rehearsal import (
    DRAFT_LOAD_CONFIG,
    draft_is_rehearsal,
    engine_kwargs,
    mark,
    refusal,
)
from eyrie.evaluate.specdec import SpecStats
from eyrie.formats.draft import DRAFT_ARCHS, UNSERVABLE_FLAGS
from eyrie.formats.tokenized import read_prompts
from eyrie.vllm.adapters import engine_environment, text_only

log = logging.getLogger(__name__)


NUM_DRAFTS = "vllm:spec_decode_num_drafts"


NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"


NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


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
    rehearsal: bool = False  # vllm.rehearsal: the target with random weights (docs/rehearsal.md)


def _posint(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def parse_settings(settings: dict, gpu_memory_utilization: float | None = None) -> VllmEvalSettings:
    """The eval and vllm settings, checked by the schema (every problem at once, each naming its
    key).

    `gpu_memory_utilization` (the CLI flag) replaces vllm.gpu_memory_utilization: it changes no
    result, so the workflow keeps it out of --settings (no rerun when it changes).
    """
    problems = flag_problems(
        "vllm.gpu_memory_utilization", gpu_memory_utilization, "--gpu-memory-utilization"
    )
    loaded = load_settings(settings, ["eval", "vllm"], EvaluateError, problems)
    ev, vl = loaded["eval"], loaded["vllm"]
    gpu = vl["gpu_memory_utilization"] if gpu_memory_utilization is None else gpu_memory_utilization
    return VllmEvalSettings(
        ev["num_speculative_tokens"],
        ev["max_new_tokens"],
        ev["num_prompts"],
        vl["tensor_parallel_size"],
        float(gpu),
        vl["enforce_eager"],
        vl["max_model_len"],
        vl["dtype"],
        vl["rehearsal"],
    )


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
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    N = info.num_hidden_layers
    if not (isinstance(aux, list) and aux and all(isinstance(i, int) and 0 <= i < N for i in aux)):
        problems.append(
            f"eagle_aux_hidden_state_layer_ids {aux!r} must be a non-empty list of "
            f"layer ids within 0..{N - 1} (the target has {N} layers)"
        )
    return problems


def check_draft_config(draft_dir: str | Path, info) -> dict:
    """Refuse, from config.json alone, a draft vLLM would not serve as trained (all problems at
    once): not EAGLE-3, flags vLLM 0.22 ignores (fc_norm, norm_output), another target's shapes,
    aux layers outside the target, no weights. Returns the config."""
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
    recorded)}."""
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
    processes and NCCL state, which deleting an LLM in-process does not reliably do; and vLLM's
    Prometheus registry, which get_metrics() reads, is process-global, so in a fresh process the
    speculative run's counters start at zero.
    """
    req_path, res_path = workdir / f"{name}.request.json", workdir / f"{name}.result.json"
    req_path.write_text(json.dumps(request))
    env = engine_environment(dict(os.environ))
    # greedy sampling never uses FlashInfer's top-k/top-p sampler; offline installs lack it
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    log.info("vLLM %s run: %d prompts (%s)", name, len(request["prompts"]), sys.executable)
    proc = subprocess.run(
        [sys.executable, "-m", "eyrie.evaluate.vllm_eval", str(req_path), str(res_path)], env=env
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
    # The HF loop's stopping rule (eyrie.evaluate.specdec): the tokenizer's eos or max_new_tokens;
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
    if draft_is_rehearsal(paths.draft):
        raise EvaluateError(
            refusal(
                Path(paths.draft) / "provenance.json",
                "a draft",
                "evaluate the draft of the run without vllm.rehearsal (results/<name>/draft), "
                "or set vllm.rehearsal: true to rehearse the evaluation",
            )
        )


def plan_evaluation(
    paths: VllmEvalPaths, settings: dict, gpu_memory_utilization: float | None
) -> VllmPlan:
    """Every check that needs no GPU, in the order a user fixes them."""
    cfg = parse_settings(settings, gpu_memory_utilization)
    try:
        info = inspect_target(paths.target)
    except TargetError as exc:
        raise EvaluateError(str(exc)) from exc
    draft_config = check_draft_config(paths.draft, info)
    check_rehearsal(paths, cfg.rehearsal)
    check_installed_vllm(paths.target)
    hf = None if paths.hf_eval is None else read_hf_eval(paths.hf_eval, cfg.K, cfg.max_new_tokens)
    prompts = read_prompts(paths.eval_set, cfg.num_prompts, info.vocab_size)
    if hf is not None:
        check_hf_prompts(paths, hf, prompts)
    max_model_len = resolve_max_model_len(cfg, info, prompts, paths.eval_set)
    return VllmPlan(paths, cfg, settings, draft_config, hf, prompts, max_model_len)


def engine_requests(plan: VllmPlan) -> tuple[dict, dict]:
    """(baseline, speculative) requests for run_engine: the same engine, with and without the
    draft."""
    cfg = plan.cfg
    engine = {
        "model": str(Path(plan.paths.target).resolve()),
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "enforce_eager": cfg.enforce_eager,
        "max_model_len": plan.max_model_len,
        "dtype": cfg.dtype,
        "disable_log_stats": False,  # get_metrics() needs the stat loggers
        # Prompts go as token ids and outputs come back as ids: no tokenizer code runs, so a
        # tokenizer saved by another transformers version than this environment's cannot break it.
        "skip_tokenizer_init": True,
        "seed": 0,
        **text_only(plan.paths.target),
        **engine_kwargs(cfg.rehearsal),  # a rehearsal: the target with random weights
    }
    # The target path is always passed: the draft's verifier.name_or_path may not resolve here.
    speculative = {
        "model": str(Path(plan.paths.draft).resolve()),
        "method": "eagle3",
        "num_speculative_tokens": cfg.K,
    }
    if cfg.rehearsal:  # the draft's own weights all the same: its loading is rehearsed too
        speculative["draft_load_config"] = dict(DRAFT_LOAD_CONFIG)
    common = {
        "engine": engine,
        "prompts": [ids for _, ids in plan.prompts],
        "max_new_tokens": cfg.max_new_tokens,
        "eos_token_id": plan.eos_token_id,
    }
    return {**common, "speculative_config": None}, {**common, "speculative_config": speculative}


def run_engines(plan: VllmPlan) -> tuple[dict, dict]:
    """The baseline and the speculative run's results (run_engine's dicts)."""
    baseline, speculative = engine_requests(plan)
    cfg = plan.cfg
    log.info(
        "evaluating %s through vLLM on %d prompts: K=%d, max_new_tokens=%d, eos %s, "
        "enforce_eager=%s, tensor_parallel_size=%d, max_model_len=%d%s",
        plan.paths.draft,
        len(plan.prompts),
        cfg.K,
        cfg.max_new_tokens,
        plan.eos_token_id,
        cfg.enforce_eager,
        cfg.tensor_parallel_size,
        plan.max_model_len,
        "; rehearsal: the target with random weights" if cfg.rehearsal else "",
    )
    with tempfile.TemporaryDirectory(prefix="eyrie-eval-vllm-") as tmp:
        base = run_engine("baseline", baseline, Path(tmp))
        spec = run_engine("speculative", speculative, Path(tmp))
    return base, spec


def check_outputs_equal(plan: VllmPlan, base: dict, spec: dict) -> int:
    """Every speculative output must equal the baseline's; otherwise write the diagnostic
    (diagnostic_path) and fail. A stale diagnostic of an earlier failed run is removed. In a
    rehearsal differences are counted (returned) and warned of, not a failure: random weights
    make near-ties of most greedy choices, where batched verification may pick another token."""
    diagnostic = diagnostic_path(plan.paths.out)
    differ = []
    for (sample_id, _), b, s in zip(plan.prompts, base["outputs"], spec["outputs"]):
        at = first_difference(s, b)
        if at is not None:
            differ.append(
                {"sample_id": sample_id, "first_difference": at, "baseline": b, "speculative": s}
            )
    if not differ:
        diagnostic.unlink(missing_ok=True)
        return 0
    write_json(
        diagnostic,
        {
            "num_prompts": len(plan.prompts),
            "outputs_differ": len(differ),
            "prompts": differ,
            "counters": spec["counters"],
            "enforce_eager": plan.cfg.enforce_eager,
            "provenance": provenance(plan.settings),
        },
    )
    first = differ[0]
    what = (
        f"{plan.paths.eval_set}: {len(differ)} of {len(plan.prompts)} speculative outputs differ "
        f"from vLLM's greedy outputs without speculation (first: prompt {first['sample_id']} at "
        f"new token {first['first_difference']})"
    )
    if plan.cfg.rehearsal:
        log.warning("%s; expected of random weights, not a failure of a rehearsal", what)
        return len(differ)
    raise EvaluateError(
        f"{what}; speculative decoding must not change greedy outputs; details in {diagnostic}"
    )


def difference(counters: dict, hf: dict) -> dict:
    """vLLM minus Hugging Face: AL and per-position acceptance (None where either is missing)."""
    al, hf_al = counters["acceptance_length"], hf["acceptance_length"]
    pp, hf_pp = counters["per_position_acceptance"], hf["per_position_acceptance"]
    return {
        "acceptance_length": None if None in (al, hf_al) else al - hf_al,
        "per_position_acceptance": (
            None
            if pp is None or not isinstance(hf_pp, list) or len(hf_pp) != len(pp)
            else [a - b for a, b in zip(pp, hf_pp)]
        ),
    }


def build_report(plan: VllmPlan, spec: dict, differ: int = 0) -> dict:
    """eval_vllm.json (docs/vllm.md, Evaluation through vLLM); `differ` outputs differed from the
    baseline's (a rehearsal's only). Without an HF evaluation `hf` and `difference` are null."""
    cfg, hf, m, n = plan.cfg, plan.hf, spec["counters"], len(plan.prompts)
    counter_keys = ("num_drafts", "num_draft_tokens", "accepted_tokens", "accepted_at_position")
    config_keys = (
        "eagle_aux_hidden_state_layer_ids",
        "draft_vocab_size",
        "norm_before_residual",
        "norm_before_fc",
    )
    return {
        "vllm_version": spec["vllm_version"],
        "K": cfg.K,
        "num_prompts": n,
        "max_new_tokens": cfg.max_new_tokens,
        "outputs_equal": n - differ,
        "output_tokens": sum(len(o) for o in spec["outputs"]),
        "acceptance_length": m["acceptance_length"],
        "per_position_acceptance": m["per_position_acceptance"],
        "counters": {k: m[k] for k in counter_keys},
        "hf": None
        if hf is None
        else {k: hf[k] for k in ("acceptance_length", "per_position_acceptance", "path", "engine")},
        "difference": None if hf is None else difference(m, hf),
        "eos_token_id": plan.eos_token_id,
        "engine": {
            "name": "vllm",
            "dtype": spec["dtype"],
            "enforce_eager": cfg.enforce_eager,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "max_model_len": plan.max_model_len,
        },
        "draft": str(plan.paths.draft),
        "draft_config": {k: plan.draft_config.get(k) for k in config_keys},
        "target": str(plan.paths.target),
        "provenance": provenance(plan.settings),
        **mark(cfg.rehearsal),  # random weights: its acceptance and outputs mean nothing
    }


def evaluate_vllm(
    paths: VllmEvalPaths, settings: dict, *, gpu_memory_utilization: float | None = None
) -> dict:
    """Run the evaluation through vLLM and write the report JSON `paths.out`; returns the report."""
    plan = plan_evaluation(paths, settings, gpu_memory_utilization)
    base, spec = run_engines(plan)
    differ = check_outputs_equal(plan, base, spec)
    report = build_report(plan, spec, differ)
    write_json(paths.out, report)
    keep_last_good(paths.out)
    log.info(
        "acceptance length: vLLM %s, Hugging Face %s; %d/%d outputs equal -> %s%s",
        report["acceptance_length"],
        plan.hf["acceptance_length"] if plan.hf else "(none)",
        report["outputs_equal"],
        len(plan.prompts),
        paths.out,
        " (rehearsal: both engines ran, the draft loaded and was served; the figures of random "
        "weights mean nothing)"
        if plan.cfg.rehearsal
        else "",
    )
    return report


def add_arguments(parser) -> None:
    from eyrie.core.runtime import settings_arg

    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--draft", required=True, help="exported draft folder (speculators format)")
    parser.add_argument("--eval-set", required=True, help="eval.parquet with prompt_ids")
    parser.add_argument(
        "--hf-eval",
        default=None,
        help="eval.json of `eyrie evaluate` (its AL goes beside vLLM's; its eos_token_id is the "
        "stop token); required but in a rehearsal (vllm.rehearsal: true)",
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
    paths = VllmEvalPaths(args.target, args.draft, args.eval_set, args.hf_eval, args.out)
    evaluate_vllm(paths, args.settings, gpu_memory_utilization=args.gpu_memory_utilization)
    return 0


if __name__ == "__main__":  # the engine worker: python -m eyrie.evaluate.vllm_eval REQUEST RESULT
    sys.exit(_worker(*sys.argv[1:]))

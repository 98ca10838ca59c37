"""evaluate-vllm, step 2 (run): the baseline and the speculative engine run, each in a fresh
process (`python -m eyrie.evaluate.vllm_eval REQUEST RESULT`), and the worker side of that
process: greedy decoding of every prompt and vLLM's spec-decode counters read back as AL
(AL = 1 + accepted / num_drafts). docs/vllm.md (Evaluation through vLLM).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eyrie.core.errors import EvaluateError
from eyrie.core.io import write_json
from eyrie.core.rehearsal import DRAFT_LOAD_CONFIG
from eyrie.evaluate.specdec import SpecStats
from eyrie.evaluate.vllm_check import VllmPlan
from eyrie.vllm.adapters import engine_environment
from eyrie.vllm.engine import bound_kwargs, bounds, engine_args

log = logging.getLogger(__name__)


# vLLM's spec-decode metrics (LLM.get_metrics()), which spec_counters reads
NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def engine_requests(plan: VllmPlan) -> tuple[dict, dict]:
    """(baseline, speculative) requests for run_engine: the same engine, with and without the
    draft."""
    cfg = plan.cfg
    engine = engine_args(
        Path(plan.paths.target).resolve(),
        cfg.vllm,
        **engine_bounds(plan),
        disable_log_stats=False,  # get_metrics() needs the stat loggers
    )
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


def engine_bounds(plan: VllmPlan) -> dict:
    """The engines' lengths (eyrie.vllm.engine.bounds), as preflight sized them: max_model_len
    the plan's (vllm.max_model_len, or the longest prompt + max_new_tokens + K)."""
    got = bounds(plan.cfg.vllm, plan.max_model_len, chunked=True, source="the plan")
    return bound_kwargs(got)


def run_engines(plan: VllmPlan) -> tuple[dict, dict]:
    """The baseline and the speculative run's results (run_engine's dicts)."""
    baseline, speculative = engine_requests(plan)
    cfg = plan.cfg
    log.info(
        "evaluating %s through vLLM on %d prompts: K=%d, max_new_tokens=%d, eos %s, "
        "enforce_eager=%s, tensor_parallel_size=%d, lengths %s%s",
        plan.paths.draft,
        len(plan.prompts),
        cfg.K,
        cfg.max_new_tokens,
        plan.eos_token_id,
        cfg.vllm.enforce_eager,
        cfg.vllm.tensor_parallel_size,
        engine_bounds(plan),
        "; rehearsal: the target with random weights" if cfg.rehearsal else "",
    )
    with tempfile.TemporaryDirectory(prefix="eyrie-eval-vllm-") as tmp:
        base = run_engine("baseline", baseline, Path(tmp))
        spec = run_engine("speculative", speculative, Path(tmp))
    return base, spec


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


def worker(request_path: str, result_path: str) -> int:
    """The engine process: `request_path`'s run, its result written to `result_path`; exit status 1
    with the traceback logged when it fails."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        result = generate(json.loads(Path(request_path).read_text()))
        write_json(result_path, result)
    except Exception:  # noqa: BLE001 - reported with type and traceback; the parent fails
        log.exception("vLLM engine run (%s) failed", request_path)
        return 1
    return 0


def generate(request: dict) -> dict:
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

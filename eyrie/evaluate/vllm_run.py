"""evaluate-vllm, step 2 (run): the baseline and the speculative engine run, each in a fresh
process (`python -m eyrie.evaluate.vllm_eval REQUEST RESULT`, EngineWorkers), and the worker side
of that process: greedy decoding of every prompt and vLLM's spec-decode counters read back as AL
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
from eyrie.evaluate.specdec import SAMPLE_SEED, SpecStats
from eyrie.evaluate.vllm_check import VllmPlan
from eyrie.vllm import fatbin
from eyrie.vllm.engine import bound_kwargs, bounds, engine_args

log = logging.getLogger(__name__)


# vLLM's spec-decode metrics (LLM.get_metrics()), which counter_totals reads
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
        # eagle3, dflash or dspark (check_draft_config refused any other)
        "method": plan.draft_config["speculators_model_type"],
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
    # eval.temperature > 0: the speculative engine samples every prompt again (seeded per
    # prompt), after its greedy run: vLLM's AL under rejection sampling
    sampled = {"temperature": cfg.temperature, "seed": SAMPLE_SEED} if cfg.temperature else None
    return (
        {**common, "speculative_config": None},
        {**common, "speculative_config": speculative, "sampled": sampled},
    )


def engine_bounds(plan: VllmPlan) -> dict:
    """The engines' lengths (eyrie.vllm.engine.bounds), as preflight sized them: max_model_len
    the plan's (vllm.max_model_len, or the longest prompt + max_new_tokens + K)."""
    got = bounds(plan.cfg.vllm, plan.max_model_len, chunked=True, source="the plan")
    return bound_kwargs(got)


def run_engines(plan: VllmPlan, workers: EngineWorkers) -> tuple[dict, dict]:
    """The baseline and the speculative run's results (run_engine's dicts), on `workers`."""
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
    base = run_engine("baseline", baseline, workers)
    spec = run_engine("speculative", speculative, workers)
    return base, spec


def run_engine(name: str, request: dict, workers: EngineWorkers) -> dict:
    """One engine run (`request`: engine kwargs, prompts, sampling) on its worker process."""
    return workers.run(name, request)


class EngineWorkers:
    """The evaluation's two engine processes (`python -m eyrie.evaluate.vllm_eval REQUEST
    RESULT`), started when the stage starts: each imports vLLM while this process checks and
    plans and the other runs its engine, then waits for its request file.

    Each of the two runs (baseline, speculative) gets a fresh Python process rather than two LLM
    instances in one: process exit releases GPU memory, vLLM's engine-core and worker processes
    and NCCL state, which deleting an LLM in-process does not reliably do; and vLLM's Prometheus
    registry, which get_metrics() reads, is process-global, so in a fresh process the
    speculative run's counters start at zero. A worker given no request (the check failed) is
    stopped on exit; it has not touched the GPU.
    """

    NAMES = ("baseline", "speculative")
    STOP_S = 10.0

    def __init__(self, command: list[str] | None = None):
        self.command = command or [sys.executable, "-m", "eyrie.evaluate.vllm_eval"]
        self.procs: dict[str, subprocess.Popen] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> EngineWorkers:
        self._tmp = tempfile.TemporaryDirectory(prefix="eyrie-eval-vllm-")
        env = dict(os.environ)
        # greedy sampling never uses FlashInfer's top-k/top-p sampler; offline installs lack it
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        for name in self.NAMES:
            req, res = self.paths(name)
            self.procs[name] = subprocess.Popen([*self.command, str(req), str(res)], env=env)
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(self.STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._tmp.cleanup()

    def paths(self, name: str) -> tuple[Path, Path]:
        folder = Path(self._tmp.name)
        return folder / f"{name}.request.json", folder / f"{name}.result.json"

    def run(self, name: str, request: dict) -> dict:
        """Hand `name`'s worker its request (renamed into place whole) and read its result."""
        req_path, res_path = self.paths(name)
        partial = req_path.with_suffix(".partial")
        partial.write_text(json.dumps(request))
        partial.rename(req_path)
        proc = self.procs[name]
        log.info(
            "vLLM %s run: %d prompts (pid %d, %s)",
            name,
            len(request["prompts"]),
            proc.pid,
            self.command[0],
        )
        returncode = proc.wait()
        if returncode != 0 or not res_path.is_file():
            raise EvaluateError(
                f"the vLLM {name} run failed (exit {returncode}); its error and "
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
    """The engine process: imports vLLM, waits for `request_path` (wait_for_request), runs it and
    writes its result to `result_path`; exit status 1 with the traceback logged when it fails,
    0 without a result when no request came."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        start = time.perf_counter()
        # the slow part, done while the parent plans or the other engine runs: `import vllm`
        # alone defers the engine's modules to the first use of vllm.LLM, and vllm.LLM the
        # platform (on a GPU its compiled ops) to the first engine built
        from vllm import LLM, SamplingParams  # noqa: F401
        from vllm.platforms import current_platform

        log.info(
            "vLLM imported in %.1f s (platform %s); waiting for the request",
            time.perf_counter() - start,
            current_platform.device_type,
        )
        request = wait_for_request(Path(request_path), os.getppid())
        if request is None:
            return 0
        write_json(result_path, generate(request))
    except Exception:  # noqa: BLE001 - reported with type and traceback; the parent fails
        log.exception("vLLM engine run (%s) failed", request_path)
        return 1
    return 0


def wait_for_request(path: Path, parent: int, poll_s: float = 0.05) -> dict | None:
    """The request once `path` exists (the parent renames it into place whole); None when the
    parent `parent` is gone first."""
    while not path.exists():
        if os.getppid() != parent:
            return None
        time.sleep(poll_s)
    return json.loads(path.read_text())


def generate(request: dict) -> dict:
    """Worker side: build the engine, decode every prompt greedily, read the counters."""
    import vllm
    from vllm import LLM

    waited = fatbin.wait_for_compilation()  # compile-kernels compiling this target's kernels
    if waited > 0.5:
        log.info("waited %.1f s for compile-kernels (its kernels load from the cache)", waited)
    start = time.perf_counter()
    llm = LLM(**request["engine"], speculative_config=request["speculative_config"])
    log.info("engine built in %.1f s", time.perf_counter() - start)
    params = sampling_params(request, temperature=0.0)
    prompts = request["prompts"]
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    # wall time includes the first call's kernel compilation (Triton JIT): a log line, no metric
    log.info("generate: %d prompts in %.2f s", len(prompts), time.perf_counter() - start)
    for ids, res in zip(prompts, results, strict=True):
        if list(res.prompt_token_ids) != ids:
            raise RuntimeError("vLLM returned outputs in another order than the prompts")
    spec = request["speculative_config"]
    K = spec["num_speculative_tokens"] if spec else 0
    greedy = counter_totals(llm.get_metrics(), K) if spec else None
    out = {
        "vllm_version": vllm.__version__,
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        "outputs": [list(res.outputs[0].token_ids) for res in results],
        "counters": stats_of(K, greedy).metrics() if spec else None,
    }
    if spec and request.get("sampled"):
        out["sampled"] = sample_again(llm, request, greedy)
    return out


def sampling_params(request: dict, **how):
    """vLLM's SamplingParams of a run of `request`, sampling as `how` says (temperature, seed):
    the HF loop's stopping rule (eyrie.evaluate.specdec), the tokenizer's eos or
    max_new_tokens; ignore_eos keeps vLLM from adding generation_config's other eos ids as stop
    tokens."""
    from vllm import SamplingParams

    eos = request["eos_token_id"]
    return SamplingParams(
        **how,
        max_tokens=request["max_new_tokens"],
        ignore_eos=True,
        stop_token_ids=[eos] if eos is not None else None,
        detokenize=False,
    )


def sample_again(llm, request: dict, greedy: dict) -> dict:
    """The speculative engine decodes every prompt again by sampling at the request's
    temperature (prompt n seeded seed + n, the greedy run's stopping rule): the figures of the
    counters' growth over the greedy run's `greedy` totals."""
    sample, prompts = request["sampled"], request["prompts"]
    K = request["speculative_config"]["num_speculative_tokens"]
    each = [
        sampling_params(request, temperature=sample["temperature"], seed=sample["seed"] + n)
        for n in range(len(prompts))
    ]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for ids in prompts], each, use_tqdm=False)
    log.info(
        "sampled at temperature %s: %.2f s", sample["temperature"], time.perf_counter() - start
    )
    grown = counter_growth(counter_totals(llm.get_metrics(), K), greedy)
    return {**sample, "counters": stats_of(K, grown).metrics()}


def counter_growth(after: dict, before: dict) -> dict:
    """counter_totals' dict of what the counters grew by from `before` to `after`."""
    grown = {k: after[k] - before[k] for k in (NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED)}
    grown[ACCEPTED_PER_POS] = [
        a - b for a, b in zip(after[ACCEPTED_PER_POS], before[ACCEPTED_PER_POS])
    ]
    return grown


def stats_of(K: int, totals: dict) -> SpecStats:
    """SpecStats of counter_totals' dict (or of the growth between two): its metrics() are
    acceptance_length = 1 + accepted_tokens / num_drafts (None without drafts),
    per_position_acceptance[k] = accepted_at_position[k] / num_drafts, and the raw counts."""
    return SpecStats(
        K,
        num_drafts=totals[NUM_DRAFTS],
        num_draft_tokens=totals[NUM_DRAFT_TOKENS],
        accepted_tokens=totals[NUM_ACCEPTED],
        accepted_at_position=list(totals[ACCEPTED_PER_POS]),
    )


def counter_totals(metrics: list, K: int) -> dict:
    """vLLM's four spec-decode counters from `LLM.get_metrics()` (vllm.v1.metrics.reader
    objects) summed over label sets, one per engine: {name: count} (the per-position one a list
    of K); EvaluateError when one is missing or they disagree."""
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
    return {**totals, ACCEPTED_PER_POS: per_pos}

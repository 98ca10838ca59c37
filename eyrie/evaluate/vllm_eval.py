"""The evaluate-vllm stage: acceptance length of an exported draft, measured by vLLM itself.

It serves the target with the exported EAGLE-3 draft through vLLM and greedily decodes the
held-out prompts twice, without and with speculation, each run in a fresh process; every
speculative output must equal the baseline token for token. AL comes from vLLM's spec-decode
counters (AL = 1 + accepted / num_drafts) and the Hugging Face evaluation's AL goes beside it;
at eval.temperature > 0 the speculative engine then samples every prompt again (eval_vllm.json
"sampled").
The steps, each a module: check (everything that needs no GPU, first: vllm_check), run (the two
engine processes, started with the stage so that they import vLLM during the check: vllm_run),
compare (vllm_compare) and report (vllm_report). Run with `-m`, this module is the engine process
(vllm_run.worker). Runs in the vLLM environment: imports vllm, torch, pyarrow and eyrie, never
eyrie.train, speculators or matplotlib. See docs/vllm.md (Evaluation through vLLM).
"""

from __future__ import annotations

import logging
import sys

from eyrie.core.io import keep_last_good, write_json
from eyrie.evaluate.vllm_check import VllmEvalPaths, plan_evaluation
from eyrie.evaluate.vllm_compare import check_outputs_equal
from eyrie.evaluate.vllm_report import build_report
from eyrie.evaluate.vllm_run import EngineWorkers, run_engines, worker

log = logging.getLogger(__name__)


def evaluate_vllm(paths: VllmEvalPaths, settings: dict, runtime: dict | None = None) -> dict:
    """Run the evaluation through vLLM and write the report JSON `paths.out`; returns the report.
    `runtime`: what the workflow reads but does not compare (vllm.gpu_memory_utilization)."""
    with EngineWorkers() as workers:  # importing vLLM while the check runs
        plan = plan_evaluation(paths, settings, runtime)
        base, spec = run_engines(plan, workers)
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
    """Its own arguments; --settings and --runtime are the CLI's (eyrie.cli)."""
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


def run(args) -> int:
    paths = VllmEvalPaths(args.target, args.draft, args.eval_set, args.hf_eval, args.out)
    evaluate_vllm(paths, args.settings, args.runtime)
    return 0


if __name__ == "__main__":  # the engine worker: python -m eyrie.evaluate.vllm_eval REQUEST RESULT
    sys.exit(worker(*sys.argv[1:]))

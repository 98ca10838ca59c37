"""The workflow through Snakemake on one GPU: each job's time and the GPU memory peak.

    python benchmarks/workflow_gpu.py rehearsal --vllm-python PY [--workdir DIR] [--until RULE]
    python benchmarks/workflow_gpu.py real --vllm-python PY [--workdir DIR] [--until RULE]

Run by benchmarks/workflow_gpu.sh (which makes the environment). `rehearsal`: a Kimi-K2.5-shaped
target (full width, 4 layers, all 384 routed experts in int4 with Kimi-K2.5's own
quantization_config) given as config.json and the demo tokenizer only, no weights, with
config/rehearsal.yaml's switch: `snakemake -c all` runs preflight, the vLLM extraction of shard
000, training, export and the vLLM evaluation. `real`: the larger demo target (quality.py's
`large` preset) with `extract.backend: vllm` and `eval.vllm: true`; then the same command again,
which must plan nothing (so must the rehearsal's), then shard 000 deleted, which must come back
from the output store without a model load. `--cache DIR`: cache.path, another run's caches.
Writes benchmarks/results/workflow-<part>-<gpu>.json. `--until RULE` stops
the run after that rule (Snakemake's --until) so that a machine whose calls are cut at 10 minutes
runs a part in two calls on one work folder: the second call finishes the run, and the JSON holds
both calls' jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests" / "support"))

import failure  # noqa: E402  (benchmarks/failure.py: each failed job's rule and cause)
from quality import PRESETS  # noqa: E402

from eyrie.core.runtime import CACHES, launch_environment  # noqa: E402

LARGE = PRESETS["large"]["demo"]  # the larger demo target of quality.py --preset large


class MemoryPeak:
    """nvidia-smi's memory.used every 200 ms in a thread; `peak` in MiB."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.wait(0.2):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
            ).stdout
            used = [int(x) for x in out.split() if x.isdigit()]
            self.peak = max([self.peak, *used])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# where caches land when cache.path does not hold them (a variable preset in the environment,
# or a library that reads none of CACHES): the home folder and torch's default under /tmp
ELSEWHERE = ("~/.cache", "~/.nv", "~/.triton", "~/.humming", "~/.deep_gemm", "/tmp/torchinductor_*")


def mib(path: Path) -> float:
    """The size of the files under `path`, in MiB."""
    files = [path] if path.is_file() else path.rglob("*")
    return round(sum(f.stat().st_size for f in files if f.is_file()) / 2**20, 1)


def caches(cache: Path) -> dict:
    """What each cache folder holds after a run: cache.path's subfolders, the caches outside it,
    and the CACHES variables the environment had already set (those win over cache.path)."""
    import glob

    launched = launch_environment()
    preset = {var: launched[var] for var in CACHES if var in launched}
    outside = [Path(p) for pat in ELSEWHERE for p in glob.glob(os.path.expanduser(pat))]
    return {
        "preset_in_environment": preset,
        "under_cache_path_mib": {p.name: mib(p) for p in sorted(cache.glob("*"))},
        "elsewhere_mib": {str(p): mib(p) for p in outside},
    }


STAMP = re.compile(r"^\s*\[(\w{3} \w{3} +\d+ [\d:]+ \d{4})\]\s*$")
STARTED = re.compile(r"^\s*(?:local)?rule (\w+):\s*$")
ENDED = re.compile(r"Finished jobid: \d+ \(Rule: (\w+)\)")


def job_times(log: str) -> list[dict]:
    """(rule, seconds) of each job from Snakemake's output: a job starts at the time stamp above
    its `rule X:` line and ends at the one above `Finished jobid: N (Rule: X)`."""
    now, started, out = None, {}, []
    for line in log.splitlines():
        if m := STAMP.match(line):
            now = datetime.strptime(" ".join(m[1].split()), "%a %b %d %H:%M:%S %Y")
        elif (m := STARTED.match(line)) and now is not None:
            started.setdefault(m[1], []).append(now)
        elif (m := ENDED.search(line)) and now is not None and started.get(m[1]):
            began = started[m[1]].pop(0)
            out.append({"rule": m[1], "s": (now - began).total_seconds()})
    return out


def child_environment() -> dict[str, str]:
    """This process's environment without the cache variables an import here set since it
    started (`quality` imports torch, which on the GPU image sets TORCHINDUCTOR_CACHE_DIR): passed
    on, they would look like the user's own to the workflow, which then keeps that cache outside
    cache.path (the seventh pass found training's graphs in /tmp/torchinductor_root)."""
    launched = launch_environment()
    return {k: v for k, v in os.environ.items() if k not in CACHES or k in launched}


def snakemake(workdir: Path, config: Path, *args: str) -> tuple[str, float]:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir)]
    cmd += [*args, "--rerun-incomplete", "-c", "all", "--configfile", str(config)]
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_environment())
    took = time.perf_counter() - began
    out = proc.stdout + proc.stderr
    log = workdir / f"snakemake-{int(time.time())}.log"
    log.write_text(out)
    if os.environ.get("OUT"):  # a folder the GPU machine's caller brings back
        shutil.copy(log, os.environ["OUT"])
    if proc.returncode:  # Snakemake's last lines, then each failed job's rule and cause line
        print(out[-8000:], flush=True)
        raise SystemExit(
            f"workflow_gpu: snakemake {' '.join(args)} failed "
            f"({failure.exit_status(proc.returncode)}; its output: {log}):\n"
            + failure.snakemake_message(out, workdir)
        )
    return out, took


def conversations(workdir: Path, n: int) -> Path:
    out = workdir / "convs.jsonl"
    if not out.is_file():
        settings = json.dumps({"demo": {"seed": 0, "num_conversations": n}})
        run = [sys.executable, "-m", "eyrie.cli", "demo-conversations", "--out", str(out)]
        subprocess.run([*run, "--settings", settings], check=True)
    return out


def rehearsal_target(workdir: Path, convs: Path) -> Path:
    """config.json of the Kimi-K2.5-shaped int4 target and the demo tokenizer: no weights."""
    from vllm_gpu_check import rehearsal_config

    from eyrie.demo.tokenizer import build_chat_tokenizer

    target = workdir / "kimi4int4"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(rehearsal_config("kimi_k25_int4"), indent=1))
    texts = [m["content"] for line in convs.open() for m in json.loads(line)["messages"]]
    build_chat_tokenizer(texts, 2048).save_pretrained(target)
    return target


def write_config(workdir: Path, config: dict) -> Path:
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_jobs(workdir: Path, config: Path, until: str | None) -> dict:
    """One `snakemake -c all` (to `until` if given) under the memory poll; the jobs of earlier
    calls on this work folder (runs.json) come first."""
    done = workdir / "runs.json"
    runs = json.loads(done.read_text()) if done.is_file() else []
    with MemoryPeak() as mem:
        out, took = snakemake(workdir, config, *(["--until", until] if until else []))
    runs.append(
        {
            "until": until,
            "s": round(took, 1),
            "jobs": job_times(out),
            "gpu_memory_peak_mib": mem.peak,
        }
    )
    done.write_text(json.dumps(runs, indent=1))
    return {
        "s": round(sum(r["s"] for r in runs), 1),
        "jobs": [job for r in runs for job in r["jobs"]],
        "gpu_memory_peak_mib": max(r["gpu_memory_peak_mib"] for r in runs),
        "calls": len(runs),
        "finished": until is None,
        "eval_vllm": eval_vllm(workdir),
        "engine_memory": engine_memory(workdir),
    }


LOADED = re.compile(r"Model loading took ([\d.]+) GiB")
KV_CACHE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")


def engine_memory(workdir: Path) -> dict | None:
    """The extraction engine's lengths and preflight's memory prediction (preflight.json), beside
    what vLLM logged at the engine's start (its weights and the KV cache it kept: the rest of
    gpu_memory_utilization went to the profiling step's activations and memory outside torch)."""
    found = sorted(workdir.glob("results/*/preflight.json"))
    logs = sorted(workdir.glob("logs/*/extract_engine/engine_*.log"))
    if not found or not logs:
        return None
    vllm = json.loads(found[0].read_text()).get("vllm") or {}
    text = logs[0].read_text()
    loaded, kv = LOADED.search(text), KV_CACHE.search(text)
    return {
        "engine": (vllm.get("engine") or {}).get("extraction"),
        "predicted_gib": (vllm.get("memory") or {}).get("extraction"),
        "vllm_weights_gib": float(loaded[1]) if loaded else None,
        "vllm_kv_cache_gib": float(kv[1]) if kv else None,
    }


def eval_vllm(workdir: Path) -> dict | None:
    """The vLLM evaluation's acceptance length and output check, once written."""
    found = sorted(workdir.glob("results/*/eval/eval_vllm.json"))
    if not found:
        return None
    ev = json.loads(found[0].read_text())
    return {k: ev.get(k) for k in ("acceptance_length", "outputs_equal", "num_prompts")}


def rehearsal(workdir: Path, vllm_python: str, until: str | None, cache: Path | None) -> dict:
    convs = conversations(workdir, 2400)
    target = rehearsal_target(workdir, convs)
    config = write_config(
        workdir,
        {
            **({"cache": {"path": str(cache)}} if cache else {}),
            "target": {"name": "kimi4", "path": str(target)},
            "data": {"conversations": [str(convs)]},
            "layers": {"aux_ids": [1, 2, 3]},  # 4 layers: the default [2, N//2, N-3] repeats
            "extract": {"backend": "vllm"},
            "train": {"epochs": 1, "checkpoint_every": 1000},  # it checks that training runs
            "vllm": {"python": vllm_python, "rehearsal": True},  # the defaults: an 80 GB GPU
        },
    )
    result = {"run": run_jobs(workdir, config, until)}
    if until:
        return result
    out, took = snakemake(workdir, config)
    result["rerun"] = {"s": round(took, 1), "nothing_to_be_done": "Nothing to be done" in out}
    return result


def real(workdir: Path, vllm_python: str, until: str | None, cache: Path | None) -> dict:
    config = write_config(
        workdir,
        {
            **({"cache": {"path": str(cache)}} if cache else {}),
            "target": {"name": "large"},
            "demo": LARGE,
            "extract": {"backend": "vllm"},
            "train": {"epochs": 1},
            "eval": {"vllm": True},
            "vllm": {"python": vllm_python},
        },
    )
    result = {"run": run_jobs(workdir, config, until)}
    if until:
        return result
    out, took = snakemake(workdir, config)
    result["rerun"] = {"s": round(took, 1), "nothing_to_be_done": "Nothing to be done" in out}
    shard = workdir / "results/large/hidden/shard_000.h5"
    shard.unlink(missing_ok=True)  # already gone where an earlier call was cut here
    engine_log = workdir / "logs/large/extract_engine/engine_000.log"
    out, took = snakemake(workdir, config, str(shard.relative_to(workdir)))
    log = engine_log.read_text()
    result["deleted_shard"] = {
        "s": round(took, 1),
        "jobs": job_times(out),
        "restored": shard.is_file(),
        "model_loads": log.count("engine: loaded target"),
        "engine_log_tail": log[-1500:],
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["rehearsal", "real"])
    parser.add_argument("--vllm-python", required=True, help="vllm.python for the runs")
    parser.add_argument("--workdir", type=Path, help="default: /tmp/eyrie-workflow-<part>")
    parser.add_argument("--until", help="stop after this rule; a later call finishes the run")
    parser.add_argument(
        "--cache",
        type=Path,
        help="cache.path (default: the work folder's results/cache): another run's caches",
    )
    args = parser.parse_args()
    workdir = args.workdir or Path(f"/tmp/eyrie-workflow-{args.part}")
    workdir.mkdir(parents=True, exist_ok=True)
    gpu = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.split("\n")[0]
    result = {"part": args.part, "gpu": gpu, "date": time.strftime("%Y-%m-%d")}
    try:
        result.update(
            (rehearsal if args.part == "rehearsal" else real)(
                workdir, args.vllm_python, args.until, args.cache
            )
        )
    finally:  # every job's log comes back (one file: a device call returns few), a failed run's too
        if os.environ.get("OUT") and (workdir / "logs").is_dir():
            logs = sorted(p for p in (workdir / "logs").rglob("*") if p.is_file())
            text = "".join(f"=== {p}\n{p.read_text(errors='replace')}" for p in logs)
            (Path(os.environ["OUT"]) / f"joblogs-{workdir.name}.txt").write_text(text)
    result["caches"] = caches(args.cache or workdir / "results" / "cache")
    print(json.dumps(result, indent=1), flush=True)
    name = re.sub(r"\W+", "-", gpu.lower()).strip("-")
    out = REPO / "benchmarks" / "results" / f"workflow-{args.part}-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if os.environ.get("OUT"):
        shutil.copy(out, os.environ["OUT"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

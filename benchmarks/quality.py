"""Draft quality: eyrie's draft against one trained by speculators 0.9.0's own trainer from the same
target, conversations and hidden states (`peer`), and eyrie's recipe choices measured one by one
(`recipe`); every draft evaluated on the same held-out prompts, at each K of --k.

    python benchmarks/quality.py peer   [--preset demo|large] [--k 3 5] [--vllm] [--workdir DIR]
                                        [--peer NAME[=SPECULATORS FLAGS]] ...
    python benchmarks/quality.py recipe [--preset demo] --variant NAME KEY=VALUE ... [--variant ...]

peer    The workflow (this repository's Snakefile, a real Snakemake run) on the preset's config up
        to eval.json, with eval K = max(--k): the target, the tokenized conversations, the
        vocabulary map, the hidden-state shards and eyrie's draft. Then the shards are converted
        to speculators' offline format (benchmarks/peer.py) and `torchrun speculators.train`
        trains its draft from them: the same verifier folder, vocabulary map, aux layers, draft
        layers and TTT steps, as many optimizer steps as eyrie's run and total_seq_len = eyrie's
        tokens per step (max_tokens_per_batch x packs_per_step); its defaults otherwise (Muon,
        linear schedule, 1% warmup, kl_div, bf16 autocast, flex attention), except its eager loss
        (its fused Triton loss failed in backward on the H200 image) and train_data_ratio 0.99
        (its default 0.9 would train on 10% fewer conversations; it refuses 1.0). Its last
        checkpoint is evaluated by `eyrie evaluate` with the workflow's own evaluation settings,
        and with --vllm also by `eyrie evaluate-vllm` (vLLM's counters) at each K.
        Each --peer is one such draft (default: `speculators`, its defaults as above); flags
        after `=` go to its trainer too, e.g. `--peer 'spec_nonorm=--no-norm-output'` for the
        draft shape eyrie trains, which vLLM 0.22 serves. The peers train side by side.
        speculators' trainer needs a GPU: on a CPU the peer is not trained, and the run stops
        after eyrie's rows (speculators' data path and flags are still checked).
recipe  The workflow once per variant, in one working folder and on one shared target: each
        variant's overrides (dotted keys of config/config.yaml, YAML values) change what they
        change, and Snakemake reruns only what depends on them (a train.* override retrains,
        exports and evaluates; the target and the hidden states stay). The first variant is the
        reference; every row gives AL at each K, the training steps and tokens.

Presets: demo = README command 1's config (the embedded target trained on the CPU); large = a
larger demo target trained on a GPU for the purpose (hidden 512, 8 layers, 4,096-token vocabulary,
4,800 conversations; a random-weight target would make acceptance meaningless).
Prints the table and writes benchmarks/results/quality-<mode>-<preset>-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import failure  # noqa: E402  (benchmarks/failure.py: each failed job's rule and cause)
import peer  # noqa: E402  (benchmarks/peer.py: speculators as the peer)

PRESETS = {
    "demo": {},
    "large": {
        "demo": {
            "num_conversations": 4800,
            "vocab_size": 4096,
            "hidden_size": 512,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "intermediate_size": 1408,
            "train_steps": 2000,
            "batch_size": 16,
            "seq_len": 256,
            "learning_rate": 1.0e-3,
            "device": "cuda",
        },
    },
}
TIMEOUT_S = 3600


def log(msg: str) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_override(text: str) -> tuple[list[str], object]:
    key, sep, value = text.partition("=")
    if not sep or "." not in key:
        raise SystemExit(f"quality: override {text!r}: give KEY=VALUE with a dotted config key")
    return key.split("."), yaml.safe_load(value)


def build_config(args, K: int, overrides: list[str], vllm: bool) -> dict:
    """config/config.yaml, then --base-config's sections, the preset's, --set and `overrides`."""
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    base = yaml.safe_load(args.base_config.read_text()) if args.base_config else {}
    for layer in (base, PRESETS[args.preset]):
        for section, values in layer.items():
            cfg[section].update(values)
    name = args.name or f"q_{args.preset}"
    cfg["target"]["name"] = name
    cfg["eval"]["num_speculative_tokens"] = K
    if vllm:
        cfg["eval"]["vllm"] = True
        cfg["vllm"]["python"] = sys.executable
    for text in [*args.set, *overrides]:
        path, value = parse_override(text)
        node = cfg
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return cfg


def snakemake(workdir: Path, cfg: dict, targets: list[str], tag: str) -> float:
    path = workdir / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-c", "all"]
    cmd += ["-d", str(workdir), *targets, "--configfile", str(path)]  # it takes a list
    cmd += ["--rerun-incomplete"]  # a run stopped in this --workdir (a call's limit) goes on
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    (workdir / f"{tag}.snakemake.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:  # Snakemake's last lines, then each failed job's rule and cause
        out = proc.stdout + proc.stderr
        sys.exit(
            f"quality: {' '.join(cmd)} failed:\n{out[-4000:]}\n"
            + failure.snakemake_message(out, workdir)
        )
    return round(time.perf_counter() - began, 1)


def eyrie_cli(args: list[str], log_path: Path, fatal: bool = True) -> str | None:
    """Run `eyrie <stage>`; None when it succeeds, else its error line (or exit when `fatal`)."""
    proc = subprocess.run(
        [sys.executable, "-m", "eyrie.cli", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    log_path.write_text(proc.stdout + proc.stderr)
    if proc.returncode == 0:
        return None
    if fatal:
        sys.exit(f"quality: eyrie {args[0]} failed (log {log_path}):\n{proc.stderr[-3000:]}")
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"eyrie {args[0]}: error")]
    return (lines or proc.stderr.strip().splitlines() or ["no output"])[-1]


class Run:
    """One workflow folder: where its outputs are, and the settings its rules compared."""

    def __init__(self, workdir: Path, cfg: dict):
        from eyrie.config.schema import validate_config

        self.workdir, self.cfg = workdir, validate_config(cfg)
        self.name = cfg["target"]["name"]
        self.res = workdir / "results" / self.name
        target = self.cfg["target"]["path"]
        self.target = Path(target) if target else self.res / "target"
        prompts = self.cfg["eval"]["prompts"]
        self.eval_set = self.res / ("eval/prompts.parquet" if prompts else "tokenized/eval.parquet")

    def shards(self) -> list[Path]:
        """The hidden-state shards the workflow wrote, in order."""
        return sorted((self.res / "hidden").glob("shard_*.h5"))

    def settings(self, rule: str, K: int) -> str:
        from eyrie.config.rules import settings_param

        cfg = json.loads(json.dumps(self.cfg))
        cfg["eval"]["num_speculative_tokens"] = K
        return settings_param(cfg, rule)

    def evaluate(self, draft: Path, out: Path, K: int, vllm: bool) -> dict:
        """`eyrie evaluate` (and `eyrie evaluate-vllm`) of `draft` at K, as the workflow's rules
        call them: {"hf": eval.json, "vllm": eval_vllm.json or None}."""
        out.mkdir(parents=True, exist_ok=True)
        hf = out / f"eval_k{K}.json"
        if not hf.exists():  # a rerun in the same --workdir (e.g. adding --vllm) keeps it
            eyrie_cli(
                [
                    "evaluate",
                    *("--target", str(self.target), "--draft", str(draft)),
                    *("--vocab", str(self.res / "vocab" / "vocab.safetensors")),
                    *("--eval-set", str(self.eval_set)),
                    *("--preflight", str(self.res / "preflight.json")),
                    *("--out", str(hf), "--plot", str(out / f"eval_k{K}.png")),
                    *("--settings", self.settings("evaluate_draft", K)),
                ],
                out / f"eval_k{K}.log",
            )
        got = {"hf": json.loads(hf.read_text()), "vllm": None}
        path = out / f"eval_vllm_k{K}.json"
        if vllm and not path.exists():
            # not fatal: vLLM may refuse a peer's draft (e.g. a field it would not read)
            refused = eyrie_cli(
                [
                    "evaluate-vllm",
                    *("--target", str(self.target), "--draft", str(draft)),
                    *("--eval-set", str(self.eval_set), "--hf-eval", str(hf)),
                    *("--out", str(path), "--settings", self.settings("evaluate_vllm", K)),
                ],
                out / f"eval_vllm_k{K}.log",
                fatal=False,
            )
            if refused:
                path.with_suffix(".refused").write_text(refused)
        if vllm and path.exists():
            got["vllm"] = json.loads(path.read_text())
        elif vllm:
            got["vllm_refused"] = path.with_suffix(".refused").read_text()
        return got


def al_cells(evals: dict, ks: list[int]) -> dict:
    """AL at each K: HF from the real decoding at that K (acceptance_length_by_k of the run with
    the largest K), vLLM from its counters at that K."""
    out = {}
    for K in ks:
        hf = evals[max(ks)]["hf"]["trained"]["acceptance_length_by_k"][K - 1]
        v = evals.get(K, {}).get("vllm")
        out[K] = {"hf": hf, "vllm": v["acceptance_length"] if v else None}
        if evals.get(K, {}).get("vllm_refused"):
            out[K]["vllm_refused"] = evals[K]["vllm_refused"]
    return out


def train_record(run: Run) -> dict:
    """Steps, tokens and the training's last accuracies per TTT position (train.json's `final`):
    a draft that underfits shows here before its AL is read."""
    summary = json.loads((run.res / "train" / "train.json").read_text())
    return {k: summary[k] for k in ("steps", "tokens", "final")}


def speculators_flags(
    run: Run, conv: dict, root: Path, steps: int, epochs: int, extra: list[str]
) -> list[str]:
    cfg, pre = run.cfg, json.loads((run.res / "preflight.json").read_text())
    train = cfg["train"]
    return [
        *("--verifier-name-or-path", str(run.target)),
        *("--data-path", str(conv["data_path"])),
        *("--save-path", str(root / "checkpoints"), "--log-dir", str(root / "logs")),
        *("--d2t-path", str(conv["d2t"]), "--t2d-path", str(conv["t2d"])),
        *("--draft-vocab-size", str(cfg["vocab"]["draft_vocab_size"])),
        *("--target-layer-ids", *map(str, pre["aux_layer_ids"])),
        *("--num-layers", str(train["num_layers"]), "--ttt-steps", str(train["ttt_steps"])),
        *("--total-seq-len", str(train["max_tokens_per_batch"] * train["packs_per_step"])),
        *("--max-steps", str(steps), "--epochs", str(epochs)),
        *("--train-data-ratio", "0.99", "--on-missing", "raise"),
        *("--loss-implementation", "eager", "--seed", str(train["seed"])),
        *extra,
    ]


def planned_steps(run: Run) -> int:
    """The steps eyrie's train_draft will take on the run's shards: its own packing plan."""
    from eyrie.formats.report import shard_expectation  # what train_draft checks shards against
    from eyrie.train.packing import PackedShards, Plan

    t = run.cfg["train"]
    expect = shard_expectation(run.res / "preflight.json")
    block = t.get("method", "eagle3") != "eagle3"  # a block drafter packs unshifted, no gaps
    gap = 0 if block else t["ttt_steps"] - 1
    data = PackedShards(
        run.shards(), expect, t["max_tokens_per_batch"], gap, True, shifted=not block
    )
    return Plan.build(data, t["seed"], t["epochs"], t["packs_per_step"]).total_steps


def speculators_batches(flags: list[str], hidden: int, n_aux: int) -> int:
    """Batches per epoch of speculators' own train loader for `flags` (built on the CPU)."""
    return len(peer.train_loader(peer.resolved(flags), hidden, n_aux))


def parse_peer(text: str) -> tuple[str, list[str]]:
    name, _, flags = text.partition("=")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name == "eyrie":
        raise SystemExit(
            f"quality: --peer {text!r}: give NAME or NAME=FLAGS, NAME of [A-Za-z0-9_.-]"
        )
    return name, shlex.split(flags)


def converted(run: Run, work: Path) -> dict:
    """The run's shards in speculators' format, once per --workdir for every peer."""
    from eyrie.formats.vocab import read_vocab

    out, record = work / "peer_data", work / "peer_data.json"
    if record.exists():
        return json.loads(record.read_text())
    d2t, t2d = read_vocab(run.res / "vocab" / "vocab.safetensors")
    t0 = time.perf_counter()
    conv = peer.convert_shards(run.shards(), d2t, t2d, out)
    conv = {k: str(v) if isinstance(v, Path) else v for k, v in conv.items()}
    conv["convert_s"] = round(time.perf_counter() - t0, 1)
    record.write_text(json.dumps(conv))  # last: a stopped conversion is redone
    return conv


def start_peer(run: Run, work: Path, name: str, extra: list[str], steps: int) -> dict:
    """Peer `name`'s training on the run's shards, started: {"proc": its process, ...}; or
    {"done": ...} when an earlier call in this --workdir trained it, {"not_run": why} without
    a GPU."""
    import torch

    root = work / name
    done = root / "peer.json"
    if done.exists():
        return {"done": json.loads(done.read_text())}
    conv = converted(run, work)
    pre = json.loads((run.res / "preflight.json").read_text())
    hidden, n_aux = pre["target"]["hidden_size"], len(pre["aux_layer_ids"])
    one = speculators_flags(run, conv, root, steps, 1, extra)
    per_epoch = speculators_batches(one, hidden, n_aux)
    epochs = math.ceil(steps / per_epoch)  # its loop takes one more step per epoch after max_steps
    flags = speculators_flags(run, conv, root, steps, epochs, extra)
    root.mkdir(parents=True, exist_ok=True)
    info = {
        "flags_beyond_common": extra,
        "samples": conv["samples"],
        "convert_s": conv["convert_s"],
        "batches_per_epoch": per_epoch,
        "epochs": epochs,
        "settings": peer.settings(flags),
    }
    if not torch.cuda.is_available():
        return {
            **info,
            "not_run": "speculators.train needs a CUDA device (its trainer calls "
            "torch.accelerator.set_device_index and autocasts on cuda)",
        }
    return {
        **info,
        "proc": peer.start(flags, root, root / "launch.json"),
        "t0": time.perf_counter(),
    }


def finish_peer(root: Path, started: dict) -> dict:
    """The started training's outcome: {"draft": its last checkpoint, steps, tokens, ...}."""
    if "done" in started or "not_run" in started:
        info = started.get("done") or started
        return {**info, "draft": Path(info["draft"])} if "draft" in info else info
    info = {k: v for k, v in started.items() if k not in ("proc", "t0")}
    proc = peer.wait(started["proc"], root, TIMEOUT_S)
    wall = time.perf_counter() - started["t0"]
    if proc.returncode != 0:
        sys.exit(
            f"quality: speculators.train failed ({root / 'speculators.log'}): {peer.failure(proc)}"
        )
    record = json.loads((root / "launch.rank0.json").read_text())
    logged = re.findall(r"global_step=(\d+)", (root / "speculators.log").read_text())
    ckpts = sorted(
        (p for p in (root / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name)
    )
    info.update(
        draft=str(ckpts[-1]),
        # a rerun in this --workdir resumes from its own last checkpoint: the steps it took
        # before are in the count, their tokens not
        steps=int(logged[-1]) + 1 if logged else len(record["steps"]),
        steps_this_process=len(record["steps"]),
        tokens=sum(s["tokens"] for s in record["steps"]),
        wall_s=round(wall, 1),
    )
    (root / "peer.json").write_text(json.dumps(info, indent=1))
    return {**info, "draft": ckpts[-1]}


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0).replace(" ", "_")
    return "cpu"


def cmd_peer(args) -> dict:
    ks, K = sorted(set(args.k)), max(args.k)
    work = args.workdir
    cfg = build_config(args, K, [], args.vllm)
    run = Run(work, cfg)
    targets = [f"results/{run.name}/eval/eval.json"]
    if args.vllm:
        targets.append(f"results/{run.name}/eval/eval_vllm.json")
    arms = dict(map(parse_peer, args.peer or ["speculators"]))
    started = {}
    if args.peer_steps:  # the states, then all trainings side by side
        states = [f"results/{run.name}/vocab/vocab.safetensors"] + [
            f"results/{run.name}/hidden/shard_{i:03d}.h5"
            for i in range(run.cfg["data"]["num_shards"])
        ]
        snakemake(work, cfg, states, "peer-states")
        if args.peer_steps == "auto":
            args.peer_steps = planned_steps(run)
            log(f"eyrie's plan: {args.peer_steps} steps")
        started = {n: start_peer(run, work, n, x, int(args.peer_steps)) for n, x in arms.items()}
    wall = snakemake(work, cfg, targets, "peer")
    log(f"workflow: {wall} s")
    evals = {"eyrie": {K: {"hf": json.loads((run.res / "eval" / "eval.json").read_text())}}}
    if args.vllm:
        evals["eyrie"][K]["vllm"] = json.loads((run.res / "eval" / "eval_vllm.json").read_text())
    budget = train_record(run)
    rows = {"eyrie": {**budget, "draft": str(run.res / "draft")}}
    for k in ks:
        if k != K and args.vllm:  # the workflow's evaluation is at K; vLLM's counters per K
            evals["eyrie"][k] = run.evaluate(run.res / "draft", work / "eyrie_eval", k, True)
    rows["eyrie"]["target"] = target_identity(run)
    for n, x in arms.items():
        if n not in started:  # not setdefault: its argument would start a second training
            started[n] = start_peer(run, work, n, x, budget["steps"])
    for n in arms:
        got = finish_peer(work / n, started[n])
        if got.get("steps") not in (None, budget["steps"]):
            sys.exit(f"quality: {n} took {got['steps']} steps, eyrie {budget['steps']}")
        rows[n] = {k: (str(v) if isinstance(v, Path) else v) for k, v in got.items()}
        if "draft" in got:
            evals[n] = {
                k: run.evaluate(got["draft"], work / f"{n}_eval", k, args.vllm)
                for k in (ks if args.vllm else [K])
            }
    finish(rows, evals, ks, K)
    return {"rows": rows, "ks": ks, "workflow_s": wall, "peer_steps": args.peer_steps}


def finish(rows: dict, evals: dict, ks: list[int], K: int) -> None:
    """Each evaluated row's AL cells, engines and greedy check, into `rows`."""
    for who in evals:
        rows[who]["al"] = al_cells(evals[who], ks)
        rows[who]["engine"] = {
            "hf": evals[who][K]["hf"]["engine"],
            "vllm": (evals[who][K].get("vllm") or {}).get("engine"),
        }
        rows[who]["outputs_match_target_greedy"] = evals[who][K]["hf"][
            "outputs_match_target_greedy"
        ]


def target_identity(run: Run) -> dict:
    """What makes two runs' targets and states the same: the target's weights and the shards."""
    import hashlib

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    def values(path: Path) -> str:  # the datasets' values; the attributes hold times and hosts
        import h5py

        h = hashlib.sha256()
        with h5py.File(path, "r") as f:
            for name in sorted(f):
                if isinstance(f[name], h5py.Dataset):
                    h.update(name.encode() + f[name][()].tobytes())
        return h.hexdigest()[:16]

    summary = run.target / "demo_training.json"
    return {
        "model_sha256": digest(run.target / "model.safetensors"),
        "shards_values_sha256": [values(p) for p in sorted((run.res / "hidden").glob("*.h5"))],
        "demo_held_out_loss": json.loads(summary.read_text())["held_out_loss"]
        if summary.exists()
        else None,
    }


def cmd_recipe(args) -> dict:
    ks, K = sorted(set(args.k)), max(args.k)
    rows = {}
    for name, *overrides in args.variant:
        cfg = build_config(args, K, overrides, False)
        run = Run(args.workdir, cfg)
        wall = snakemake(args.workdir, cfg, [f"results/{run.name}/eval/eval.json"], name)
        report = json.loads((run.res / "eval" / "eval.json").read_text())
        rows[name] = {
            "overrides": overrides,
            **train_record(run),
            "al": al_cells({K: {"hf": report}}, ks),
            "per_position": report["trained"]["per_position_acceptance"],
            "wall_s": wall,
        }
        rows[name]["paired"] = paired(report, rows) if len(rows) > 1 else None  # not itself
        rows[name]["per_prompt_counts"] = report["trained"].get("per_prompt")
        rows[name]["sample_ids"] = report.get("sample_ids")
        shutil.copy(run.res / "eval" / "eval.json", args.workdir / f"{name}.eval.json")
        shutil.copy(
            run.workdir / "logs" / run.name / "train_draft.log", args.workdir / f"{name}.train.log"
        )
        # each row as it comes: a long study stopped early keeps what it measured
        (args.workdir / "recipe.partial.json").write_text(json.dumps({"rows": rows, "ks": ks}))
        log(f"{name}: AL {[rows[name]['al'][k]['hf'] for k in ks]} ({wall} s)")
    return {"rows": rows, "ks": ks}


def paired(report: dict, rows: dict) -> dict | None:
    """This variant's AL at the top K over the first variant's (the first of `rows`, already
    measured), paired by prompt: both decoded the same prompts (their eval.json's sample_ids),
    eyrie.evaluate.interval.ratio_interval over their per-prompt counts; None without them."""
    from eyrie.evaluate.interval import ratio_interval

    first = next(iter(rows.values()))
    mine, ref = report["trained"].get("per_prompt"), first.get("per_prompt_counts")
    if not mine or not ref or first.get("sample_ids") != report.get("sample_ids"):
        return None
    return ratio_interval(mine, ref)


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(mode: str, result: dict) -> str:
    ks, rows = result["ks"], result["rows"]
    lines = []
    if mode == "peer":
        head = [f"AL K={k} ({e})" for k in ks for e in ("eyrie eval", "vLLM")]
        lines.append("| trainer | steps | tokens | " + " | ".join(head) + " |")
        lines.append("|---" * (3 + len(head)) + "|")
        for who, r in rows.items():
            al = r.get("al", {})
            cells = [fmt(al.get(k, {}).get(e)) for k in ks for e in ("hf", "vllm")]
            lines.append(
                f"| {who} | {r.get('steps', '-')} | {r.get('tokens', '-')} | "
                + " | ".join(cells)
                + " |"
            )
        for who, r in rows.items():
            if who == "eyrie" or "al" not in r:
                continue
            ratio = [
                fmt(rows["eyrie"]["al"][k][e] / r["al"][k][e])
                if r["al"][k][e] and rows["eyrie"]["al"][k][e]
                else "-"
                for k in ks
                for e in ("hf", "vllm")
            ]
            lines.append(f"| eyrie / {who} | | | " + " | ".join(ratio) + " |")
    else:
        ref = next(iter(rows.values()))
        head = [f"AL K={k}" for k in ks] + [f"x first K={k}" for k in ks]
        head += [f"x first K={ks[-1]}, 95% paired", "train acc"]
        lines.append("| variant | overrides | steps | " + " | ".join(head) + " |")
        lines.append("|---" * (3 + len(head)) + "|")
        for name, r in rows.items():
            al = [r["al"][k]["hf"] for k in ks]
            rel = [f"{a / ref['al'][k]['hf']:.3f}" for a, k in zip(al, ks)]
            acc = "/".join(f"{a:.2f}" for a in r.get("final", {}).get("full_acc", [])) or "-"
            p = r.get("paired") or {}
            ci = p.get("ci95")
            pair = f"{ci[0]:.3f} - {ci[1]:.3f}" if ci else "-"
            lines.append(
                f"| {name} | {' '.join(r['overrides']) or '(defaults)'} | {r['steps']} | "
                + " | ".join([*map(fmt, al), *rel, pair, acc])
                + " |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["peer", "recipe"])
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    p.add_argument("--k", type=int, nargs="+", default=[3, 5], help="speculative tokens K")
    p.add_argument(
        "--vllm", action="store_true", help="also vLLM's counters (GPU, vLLM importable)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run (e.g. data.regenerate=true)",
    )
    p.add_argument(
        "--variant",
        action="append",
        nargs="+",
        default=[],
        metavar="NAME [KEY=VALUE ...]",
        help="recipe: a variant and its overrides",
    )
    p.add_argument("--workdir", type=Path, default=None, help="kept; default a temporary folder")
    p.add_argument(
        "--name",
        default=None,
        help="target.name (default q_<preset>): with the same "
        "--workdir, recipe variants reuse a peer run's target and states",
    )
    p.add_argument(
        "--peer-steps",
        type=lambda v: v if v == "auto" else int(v),
        default=None,
        help="peer: the peers' steps, N or auto (eyrie's own plan, read from the shards): they "
        "then train beside eyrie's training (checked equal to eyrie's steps at the end)",
    )
    p.add_argument(
        "--peer",
        action="append",
        default=None,
        metavar="NAME[=FLAGS]",
        help="peer: a speculators draft to train, with flags for its trainer beyond the common "
        "ones (default: one, `speculators`, at its defaults); repeat for several",
    )
    p.add_argument("--out", type=Path, default=None, help="the JSON (default benchmarks/results/)")
    p.add_argument(
        "--base-config",
        type=Path,
        default=None,
        help="a YAML of config sections over config/config.yaml (before the preset)",
    )
    args = p.parse_args()
    if args.mode == "recipe" and not args.variant:
        p.error("recipe needs at least one --variant")
    keep = args.workdir is not None
    args.workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="quality-"))).resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    result = cmd_peer(args) if args.mode == "peer" else cmd_recipe(args)
    result.update(
        mode=args.mode,
        preset=args.preset,
        date=str(date.today()),
        host=platform.node(),
        device=device_name(),
        wall_s=round(time.perf_counter() - began, 1),
        command="python benchmarks/quality.py " + " ".join(sys.argv[1:]),
    )
    text = table(args.mode, result)
    print(text)
    name = f"quality-{args.mode}-{args.preset}-{result['device']}.json"
    out = args.out or REPO / "benchmarks" / "results" / name
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    log(f"wrote {out}")
    if not keep:
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

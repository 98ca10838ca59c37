"""Draft training on one GPU: eyrie's `eyrie train` against speculators 0.9.0's own trainer
(`torchrun -m speculators.train`, its defaults otherwise), in one run, on the same hidden
states, the same draft and the same token budget per optimizer step.

  data   random bf16 hidden states (seeded; samples of --min-len..--max-len tokens, loss mask on
         the last ~60% of each), written once through eyrie's ShardWriter into HDF5 shards, then
         converted from those shards to speculators' format (`hidden_states/hs_<i>.safetensors`
         with `hidden_states` [T, n_aux + 1, H] bf16 and `token_ids` [T], plus an Arrow dataset
         with input_ids / loss_mask / seq_len) and checked with speculators' own ArrowDataset and
         collate function. Sized to what the steps consume; files stay in the page cache.
  target a random-weight "verifier" folder: config.json of Llama-3.1-8B's shape, a tokenizer, and
         only the tensors the draft reads (embed_tokens, lm_head, final norm; bf16).
  draft  1 layer, hidden 4096, target vocab 128256, draft vocab 32000 (eyrie's vocabulary map,
         from the data's assistant tokens, handed to speculators as d2t/t2d .npy), 3 TTT steps.
  runs   (A) `python -m eyrie train` (its CLI, one process), --max-tokens per pack (8192) x
             --packs-per-step packs (1) per step, one epoch; with --gpus 2 also twice the packs per
             step on one process and on two (`--nproc-per-node 2`), half the steps;
         (B) `torchrun --nproc-per-node 1 benchmarks/speculators_launch.py -- <flags>`: runpy runs
             speculators.train as __main__ with total_seq_len = the same token budget per step,
             max_steps = warm-up + measured + 1 and epochs 1 (its default 20 would add an epoch-end
             checkpoint and validation pass per epoch after max_steps); everything else default
             (optimizer muon, bf16 autocast, flex attention, 12 loader workers, log_freq 1), except
             its loss implementation: eager, the one eyrie uses (--speculators-loss; its fused
             Triton loss failed in backward on the H200 image, torch 2.11 + triton 3.6).

Measured over steady-state steps (after --warmup steps): tokens/s (real tokens: document_ids >= 0),
peak GPU memory (torch.cuda.max_memory_allocated in the training process), and the fraction of
step time blocked waiting for data (eyrie: its own `data_wait_s` per step; speculators: the
launcher times each `next()` on its train loader). With --gpus 2: eyrie's scaling (2 processes
against 1 on the same global batch of 2 x --packs-per-step packs: --packs-per-step per rank) and
the largest difference of their final weights and losses.
Goals (BENCHMARKS.md): eyrie/speculators tokens/s >= 1.2, peak memory <= 1.0x, data wait < 5%;
2-GPU scaling >= 1.8x with results identical to one GPU.

    python benchmarks/training_gpu.py                 # H200: the BENCHMARKS.md run
    python benchmarks/training_gpu.py --gpus 2        # also eyrie on 2 GPUs (nvidia-h200-x2)
    python benchmarks/training_gpu.py --tiny          # small shapes on CPU: checks the script

speculators' trainer needs a CUDA device (under torchrun it calls
torch.accelerator.set_device_index, which fails without an accelerator; its Trainer moves the
model to device index LOCAL_RANK and autocasts on "cuda"); on a machine without one, (B) is
skipped and only its data path (the conversion, read back by its ArrowDataset and collated by its
CollateFn) is checked.
Prints a table and writes benchmarks/results/training-<device>.json (training-tiny-cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import failure  # noqa: E402  (benchmarks/failure.py: a failed child's cause line)
import peer  # noqa: E402  (benchmarks/peer.py: speculators as the peer)

SHAPES = {
    # Llama-3.1-8B's verifier shape; the draft's aux layers are EAGLE-3's default [2, N//2, N-3].
    "full": dict(
        hidden=4096,
        vocab=128256,
        draft_vocab=32000,
        layers=32,
        heads=32,
        kv_heads=8,
        intermediate=14336,
        aux=[2, 16, 29],
        final=32,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        hidden=64,
        vocab=512,
        draft_vocab=128,
        layers=8,
        heads=4,
        kv_heads=2,
        intermediate=128,
        aux=[2, 4, 5],
        final=8,
        rope_theta=10000.0,
    ),
}
TTT_STEPS = 3
TOKENIZER_TEXTS = ["the draft model predicts the next tokens of the target model"] * 4


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- target, vocabulary, data


def build_target(folder: Path, shape: dict, seed: int) -> dict:
    """config.json, tokenizer and the three tensors the draft loads; preflight fields."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from eyrie.arch.target import fingerprint, read_config, tokenizer_hash
    from eyrie.demo.tokenizer import build_chat_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_chat_tokenizer(TOKENIZER_TEXTS, 300)
    tok.save_pretrained(folder)
    H, V = shape["hidden"], shape["vocab"]
    LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=8192,
        rope_theta=shape["rope_theta"],
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="bfloat16",
    ).save_pretrained(folder)
    g = torch.Generator().manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return torch.empty(*size, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)

    weights = {
        "model.embed_tokens.weight": rand(V, H),
        "lm_head.weight": rand(V, H),  # [V, H]
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
    }
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return {
        "fingerprint": fingerprint(read_config(folder)),
        "tokenizer_hash": tokenizer_hash(folder),
    }


def plan_samples(shape: dict, args, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids int32 [T], loss_mask uint8 [T]) of just enough samples that eyrie's one-epoch
    plan has warmup + steps steps and speculators' sampler (on its 90% train split) one more."""
    from speculators.train.distributed_batch_sampler import (
        MultipackDistributedBatchSamplerV2,
    )

    from eyrie.train.packing import epoch_order, pack

    rng = np.random.default_rng(seed)
    need = args.warmup + args.steps
    gap, P, budget = TTT_STEPS - 1, args.packs_per_step, args.max_tokens * args.packs_per_step
    samples: list[tuple[np.ndarray, np.ndarray]] = []
    while True:
        for _ in range(8):
            T = int(rng.integers(args.min_len, args.max_len + 1))
            ids = rng.integers(0, shape["vocab"], T).astype(np.int32)
            mask = np.zeros(T, np.uint8)
            mask[int(round(0.4 * T)) :] = 1  # the "assistant" part: ~60% of the tokens
            samples.append((ids, mask))
        lengths = [len(s[0]) for s in samples]
        eyrie_steps = (
            len(
                pack(
                    [n - 1 for n in lengths], epoch_order(len(lengths), 0, 0), args.max_tokens, gap
                )
            )
            // P
        )
        train_split = lengths[: int(len(lengths) * 0.9)]  # speculators' train_data_ratio 0.9
        spec_steps = (
            len(MultipackDistributedBatchSamplerV2(budget, train_split, 1, 0, seed=42))
            if train_split
            else 0
        )
        if eyrie_steps >= need and spec_steps >= need + 1:
            return samples


def write_world(
    root: Path, shape: dict, samples, target_ids: dict, n_shards: int, seed: int
) -> dict:
    """eyrie's inputs: vocab.safetensors (eyrie's map), preflight.json, HDF5 shards (bf16)."""
    from safetensors.torch import save_file

    from eyrie.data.vocab import select_draft_ids, vocab_mappings
    from eyrie.formats.hidden import ShardMeta
    from eyrie.formats.hidden_writer import ShardWriter

    V, H, aux = shape["vocab"], shape["hidden"], shape["aux"]
    counts = np.zeros(V, np.int64)
    for ids, mask in samples:
        np.add.at(counts, ids[mask == 1], 1)
    d2t, t2d = vocab_mappings(select_draft_ids(counts, shape["draft_vocab"]), V)
    save_file({"d2t": d2t, "t2d": t2d}, str(root / "vocab.safetensors"))
    meta = dict(
        target_fingerprint=target_ids["fingerprint"],
        tokenizer_hash=target_ids["tokenizer_hash"],
        aux_layer_ids=aux,
        final_layer_id=shape["final"],
        hidden_size=H,
    )
    (root / "preflight.json").write_text(
        json.dumps(
            {
                "ok": True,
                "aux_layer_ids": aux,
                "final_layer_id": shape["final"],
                "target": {
                    "path": str(root / "target"),
                    "model_type": "llama",
                    "num_hidden_layers": shape["layers"],
                    "hidden_size": H,
                    "vocab_size": V,
                    "fingerprint": target_ids["fingerprint"],
                    "tokenizer_hash": target_ids["tokenizer_hash"],
                },
            }
        )
    )
    # Random rows of a seeded pool: every sample gets its own values without generating each.
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(4 * max(len(s[0]) for s in samples), len(aux) + 1, H, generator=g).to(
        torch.bfloat16
    )
    bounds = np.linspace(0, len(samples), n_shards + 1).astype(int)
    shards = []
    for s in range(n_shards):
        part = range(bounds[s], bounds[s + 1])
        path = root / "shards" / f"shard_{s:03d}.h5"
        with ShardWriter(
            path,
            ShardMeta(**meta),
            [f"bench:{i}" for i in part],
            [samples[i][0].tolist() for i in part],
            [samples[i][1].tolist() for i in part],
        ) as w:
            for j, i in enumerate(part):
                T = len(samples[i][0])
                hs = pool[torch.randint(0, pool.shape[0], (T,), generator=g)]  # [T, n_aux + 1, H]
                w.put(j, hs[:, :-1].reshape(T, len(aux) * H), hs[:, -1])
        shards.append(path)
    return {
        "target": root / "target",
        "preflight": root / "preflight.json",
        "vocab": root / "vocab.safetensors",
        "shards": shards,
        "d2t": d2t,
        "t2d": t2d,
    }


def check_converted(world: dict, conv: dict, shape: dict, budget: int) -> dict:
    """Read the converted set back with speculators' ArrowDataset (on_missing=raise) and collate
    a packed batch with its CollateFn + shift_batch: values equal eyrie's, shapes as it trains."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    from eyrie.formats.hidden import ShardReader

    ds = ArrowDataset(
        max_len=budget, datapath=str(conv["data_path"]), on_missing="raise", train_ratio=1.0
    )
    first = []
    with ShardReader(world["shards"][0]) as reader:
        for i in range(min(3, len(reader))):
            item, ref = ds[i], reader.read(i)
            assert isinstance(item, dict), f"speculators could not read sample {i}: {item}"
            assert torch.equal(item["input_ids"], ref["input_ids"])
            assert torch.equal(item["hidden_states"], ref["aux_hidden"])
            assert torch.equal(item["verifier_last_hidden_states"], ref["final_hidden"])
            assert torch.equal(item["loss_mask"].bool(), ref["loss_mask"])
            first.append(item)
    batch = CollateFn(budget, shape["hidden"], len(shape["aux"]), preprocess=shift_batch)(first)
    n_aux_h = len(shape["aux"]) * shape["hidden"]
    assert batch["hidden_states"].shape == (1, budget, n_aux_h), batch["hidden_states"].shape
    return {
        "samples": len(ds),
        "collated_tokens": int((batch["document_ids"] != -1).sum()),
        "checked_samples": len(first),
    }


# ---------------------------------------------------------------- runs


def run_eyrie(world: dict, root: Path, args, gpus: int, device: str, packs: int) -> dict:
    """`python -m eyrie train` with `packs` packs per step (with --nproc-per-node: eyrie starts
    torchrun itself)."""
    settings = {
        "train": {
            "seed": 0,
            "device": device,
            "epochs": 1,
            "num_layers": 1,
            "ttt_steps": TTT_STEPS,
            "max_tokens_per_batch": args.max_tokens,
            "packs_per_step": packs,
            "log_every": args.warmup,
            "checkpoint_every": 1_000_000,
        }
    }
    cmd = [
        sys.executable,
        "-m",
        "eyrie",
        "train",
        "--target",
        str(world["target"]),
        "--preflight",
        str(world["preflight"]),
        "--vocab",
        str(world["vocab"]),
        "--shards",
        *map(str, world["shards"]),
        "--out-dir",
        str(root / "train"),
        "--state-dir",
        str(root / "state"),
        "--settings",
        json.dumps(settings),
        "--nproc-per-node",
        str(gpus),
    ]
    env = dict(os.environ)
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout
    )
    wall = time.perf_counter() - t0
    (root / "eyrie.log").write_text(proc.stdout + proc.stderr)
    shutil.rmtree(root / "state", ignore_errors=True)  # its checkpoint: GBs of disk, not needed
    if proc.returncode != 0:
        raise SystemExit(
            f"eyrie train ({gpus} process(es)) failed ({failure.exit_status(proc.returncode)}); "
            f"see {root / 'eyrie.log'}:\n{proc.stderr[-3000:]}\n"
            f"cause: {failure.cause(proc.stdout + proc.stderr) or 'no error line in its output'}"
        )
    summary = json.loads((root / "train" / "train.json").read_text())
    records = [json.loads(ln) for ln in (root / "train" / "metrics.jsonl").read_text().splitlines()]
    row = eyrie_steady(records, args.warmup)
    row.update(
        process_wall_s=round(wall, 1),
        steps=summary["steps"],
        world_size=summary["world_size"],
        peak_memory_bytes=summary.get("peak_gpu_memory_bytes"),
        data_wait_fraction_all_steps=summary.get("data_wait_fraction"),
        final_loss=records[-1]["loss"],
    )
    return row


def eyrie_steady(records: list[dict], warmup: int) -> dict:
    """Steps warmup+1..last. `wall_s` is exact at log steps (multiples of log_every = warmup, and
    the last), where eyrie waits for the device; step s's batches were fetched during step s-1."""
    by_step = {r["step"]: r for r in records}
    last = records[-1]["step"]
    if warmup not in by_step or last <= warmup + 1:
        raise SystemExit(f"eyrie ran {last} steps; need more than --warmup {warmup} + 1")
    dt = by_step[last]["wall_s"] - by_step[warmup]["wall_s"]
    tokens = sum(by_step[s]["tokens"] for s in range(warmup + 1, last + 1))
    wait = sum(by_step[s]["data_wait_s"] for s in range(warmup + 2, last + 1))
    return {
        "measured_steps": last - warmup,
        "tokens_per_step": tokens / (last - warmup),
        "tokens_per_s": tokens / dt,
        "data_wait_fraction": wait / dt,
        "measured_s": dt,
    }


def speculators_flags(world: dict, conv: dict, root: Path, args, shape: dict) -> list[str]:
    """`speculators.train` flags: the same data, draft and token budget; its defaults otherwise."""
    return [
        "--verifier-name-or-path",
        str(world["target"]),
        "--data-path",
        str(conv["data_path"]),
        "--save-path",
        str(root / "checkpoints"),
        "--log-dir",
        str(root / "logs"),
        "--d2t-path",
        str(conv["d2t"]),
        "--t2d-path",
        str(conv["t2d"]),
        "--draft-vocab-size",
        str(shape["draft_vocab"]),
        "--target-layer-ids",
        *map(str, shape["aux"]),
        "--num-layers",
        "1",
        "--ttt-steps",
        str(TTT_STEPS),
        "--total-seq-len",
        str(args.max_tokens * args.packs_per_step),
        "--max-steps",
        str(args.warmup + args.steps + 1),
        "--epochs",
        "1",
        "--on-missing",
        "raise",
        "--loss-implementation",
        args.speculators_loss,
    ]


def check_speculators_setup(world: dict, conv: dict, root: Path, args, shape: dict) -> dict:
    """Without a GPU: speculators' own config resolution of the run's flags, its vocabulary map
    loading, draft construction from the target folder and train loader (no workers), and one
    forward with its loss on a batch (sdpa and eager loss on the CPU); what its trainer would
    get."""
    import speculators.train.cli as cli
    from speculators.losses import resolve_loss_config
    from speculators.model import SpeculatorModel

    a = peer.resolved(speculators_flags(world, conv, root, args, shape))
    d2t, t2d, draft_vocab = cli.parse_vocab_mappings(a)
    a.draft_attn_impl = "sdpa"
    model = cli.build_draft_model(a, SpeculatorModel.registry["eagle3"], t2d, d2t, draft_vocab)
    train_loader = peer.train_loader(a, shape["hidden"], len(shape["aux"]))
    batch = next(iter(train_loader))
    kwargs, _ = model.get_trainer_kwargs(**vars(a))
    kwargs["loss_config"] = resolve_loss_config(a.loss_fn, "eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss, _ = model(
            **{k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}, **kwargs
        )
    if not torch.isfinite(loss):
        raise SystemExit(f"speculators' draft gave a non-finite loss on the converted data: {loss}")
    return {
        "train_batches": len(train_loader),
        "draft_vocab": draft_vocab,
        "mask_token_id": a.mask_token_id,
        "loss": float(loss.detach()),
        "batch_tokens": int((batch["document_ids"] != -1).sum()),
    }


def run_speculators(world: dict, conv: dict, root: Path, args, shape: dict) -> dict:
    """speculators.train under torchrun through benchmarks/speculators_launch.py."""
    flags = speculators_flags(world, conv, root, args, shape)
    out = root / "launch.json"
    proc, wall = peer.run(flags, root, out, args.timeout)
    shutil.rmtree(root / "checkpoints", ignore_errors=True)  # its epoch-end checkpoint
    if proc.returncode != 0:  # reported in the table and the JSON; eyrie's runs still go ahead
        if os.environ.get("OUT"):  # the device tool brings $OUT back
            shutil.copy(root / "speculators.log", Path(os.environ["OUT"]) / "speculators.log")
        return {"failed": peer.failure(proc)}
    rec = json.loads(out.with_name("launch.rank0.json").read_text())
    steps, W = rec["steps"], args.warmup
    if len(steps) < W + 2:
        raise SystemExit(f"speculators ran {len(steps)} steps; need --warmup {W} + 2")
    # step i runs from its request to the next request (the trainer synchronizes before asking)
    dt = steps[-1]["request"] - steps[W]["request"]
    measured = steps[W:-1]
    tokens = sum(s["tokens"] for s in measured)
    return {
        "measured_steps": len(measured),
        "tokens_per_step": tokens / len(measured),
        "tokens_per_s": tokens / dt,
        "measured_s": dt,
        "data_wait_fraction": sum(s["got"] - s["request"] for s in measured) / dt,
        "peak_memory_bytes": rec["peak_memory_bytes"],
        "process_wall_s": round(wall, 1),
        "steps": len(steps),
        "flags": flags,
    }


def compare_runs(a: Path, b: Path) -> dict:
    """Largest differences between two eyrie runs' final weights and per-step losses."""
    from safetensors.torch import load_file

    wa = load_file(str(a / "train" / "draft" / "model.safetensors"))
    wb = load_file(str(b / "train" / "draft" / "model.safetensors"))
    diffs = {
        k: float((wa[k].double() - wb[k].double()).abs().max()) if wa[k].numel() else 0.0
        for k in wa
    }
    la = [json.loads(ln)["loss"] for ln in (a / "train" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(ln)["loss"] for ln in (b / "train" / "metrics.jsonl").read_text().splitlines()]
    same_steps = bool(la) and len(la) == len(lb)
    return {
        "weights_max_abs_diff": max(diffs.values()),
        "worst_tensor": max(diffs, key=diffs.get),
        "weights_identical": wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa),
        "loss_max_abs_diff": max(abs(x - y) for x, y in zip(la, lb)) if same_steps else None,
        "losses_identical": la == lb,
    }


# ---------------------------------------------------------------- main


def gib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / 2**30:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="small shapes (a CPU check of the script)")
    p.add_argument(
        "--gpus",
        type=int,
        default=1,
        choices=(1, 2),
        help="2: also eyrie with 2 processes on the same global batch",
    )
    p.add_argument("--warmup", type=int, default=6, help="steps left out of the measurement")
    p.add_argument("--steps", type=int, default=24, help="measured steps (at least)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="eyrie train.max_tokens_per_batch (default 8192; --tiny 128)",
    )
    p.add_argument(
        "--packs-per-step",
        type=int,
        default=1,
        help="eyrie train.packs_per_step; speculators' total_seq_len = max-tokens x this",
    )
    p.add_argument("--min-len", type=int, default=None, help="sample tokens, least (default 1024)")
    p.add_argument("--max-len", type=int, default=None, help="sample tokens, most (default 2048)")
    p.add_argument("--shards", type=int, default=4, help="eyrie HDF5 shards")
    p.add_argument(
        "--speculators-loss",
        choices=("fused", "eager"),
        default="eager",
        help="speculators' loss_implementation; its default, fused, failed in its Triton "
        "backward kernel on torch 2.11 / triton 3.6 (H200, 2026-11-30), and eager "
        "is the implementation eyrie's training uses",
    )
    p.add_argument(
        "--skip-speculators", action="store_true", help="only eyrie (and the conversion)"
    )
    p.add_argument("--timeout", type=int, default=900, help="seconds per training process")
    p.add_argument("--work", type=Path, default=None, help="local folder for data and runs")
    p.add_argument("--keep", action="store_true", help="keep --work")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    shape = SHAPES["tiny" if args.tiny else "full"]
    args.max_tokens = args.max_tokens or (128 if args.tiny else 8192)
    args.min_len = args.min_len or (16 if args.tiny else 1024)
    args.max_len = args.max_len or (64 if args.tiny else 2048)
    if args.warmup < 1 or args.steps < 2:
        p.error(
            "--warmup must be >= 1 (eyrie logs, and waits for the device, every --warmup steps) "
            "and --steps >= 2"
        )
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if args.gpus > (torch.cuda.device_count() if cuda else 1):
        p.error(
            f"--gpus {args.gpus}: only {torch.cuda.device_count() if cuda else 0} GPU(s) visible"
        )
    budget = args.max_tokens * args.packs_per_step
    work = Path(args.work or tempfile.mkdtemp(prefix="eyrie-train-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    phases: dict[str, float] = {}
    try:
        t = time.perf_counter()
        ids = build_target(work / "target", shape, seed=0)
        samples = plan_samples(shape, args, seed=0)
        world = write_world(work, shape, samples, ids, args.shards, seed=1)
        phases["eyrie_data_s"] = time.perf_counter() - t
        t = time.perf_counter()
        conv = peer.convert_shards(
            world["shards"], world["d2t"], world["t2d"], work / "speculators_data"
        )
        check = check_converted(world, conv, shape, budget)
        phases["conversion_s"] = time.perf_counter() - t
        tokens = sum(len(s[0]) for s in samples)
        log(
            f"data: {len(samples)} samples, {tokens} tokens, {len(world['shards'])} shards; "
            f"converted and read back by speculators' ArrowDataset ({check['samples']} samples) "
            f"in {phases['conversion_s']:.0f} s"
        )

        runs: dict[str, dict] = {}
        spec_note, spec_check = None, None
        spec_settings = peer.settings(
            speculators_flags(world, conv, work / "run_speculators", args, shape)
        )
        log(f"speculators' settings (flags + its defaults): {spec_settings}")
        if args.skip_speculators:
            spec_note = "skipped (--skip-speculators)"
        elif not cuda:
            spec_note = (
                "not run: speculators.train needs an accelerator (its distributed setup "
                "calls torch.accelerator.set_device_index; the Trainer moves the model to "
                "device LOCAL_RANK and autocasts on cuda); checked instead: its config, "
                "vocabulary map, draft, train loader and loss on the converted data"
            )
            spec_check = check_speculators_setup(world, conv, work / "run_speculators", args, shape)
            log(
                f"speculators (CPU check): {spec_check['train_batches']} train batches, "
                f"loss {spec_check['loss']:.3f} on one batch"
            )
        else:
            t = time.perf_counter()
            got = run_speculators(world, conv, work / "run_speculators", args, shape)
            phases["speculators_s"] = time.perf_counter() - t
            if "failed" in got:
                spec_note = f"failed ({got['failed']})"
                log(f"speculators: {spec_note}")
            else:
                runs["speculators"] = got
                log(f"speculators: {got['tokens_per_s']:.0f} tok/s")
        t = time.perf_counter()
        runs["eyrie"] = run_eyrie(world, work / "run_eyrie_1", args, 1, device, args.packs_per_step)
        phases["eyrie_1_s"] = time.perf_counter() - t
        log(f"eyrie, 1 process: {runs['eyrie']['tokens_per_s']:.0f} tok/s")
        parity = None
        if args.gpus == 2:  # the same global batch of 2 x --packs-per-step packs on 1 and 2 GPUs
            t = time.perf_counter()
            P2 = 2 * args.packs_per_step
            runs["eyrie_1x"] = run_eyrie(world, work / "run_eyrie_1x", args, 1, device, P2)
            phases["eyrie_1x_s"] = time.perf_counter() - t
            tok_s = runs["eyrie_1x"]["tokens_per_s"]
            log(f"eyrie, 1 process, {P2} packs per step: {tok_s:.0f} tok/s")
            t = time.perf_counter()
            runs["eyrie_2"] = run_eyrie(world, work / "run_eyrie_2", args, 2, device, P2)
            phases["eyrie_2_s"] = time.perf_counter() - t
            parity = compare_runs(work / "run_eyrie_1x", work / "run_eyrie_2")
            log(f"eyrie, 2 processes: {runs['eyrie_2']['tokens_per_s']:.0f} tok/s")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    e, s = runs["eyrie"], runs.get("speculators")
    ratios = {}
    if s:
        ratios = {
            "tokens_per_s": e["tokens_per_s"] / s["tokens_per_s"],
            "peak_memory": (e["peak_memory_bytes"] / s["peak_memory_bytes"])
            if e["peak_memory_bytes"] and s["peak_memory_bytes"]
            else None,
        }
    scaling = (
        runs["eyrie_2"]["tokens_per_s"] / runs["eyrie_1x"]["tokens_per_s"]
        if "eyrie_2" in runs
        else None
    )
    goals = {
        "tokens_per_s_ratio": 1.2,
        "peak_memory_ratio": 1.0,
        "data_wait_fraction": 0.05,
        "scaling_2_gpus": 1.8,
    }
    name = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"

    print(
        f"\ndraft training on {name} ({date.today()}): 1 layer, hidden {shape['hidden']}, vocab "
        f"{shape['vocab']} -> {shape['draft_vocab']}, {TTT_STEPS} TTT steps, {budget} tokens per "
        "step "
        f"(eyrie {args.packs_per_step} x {args.max_tokens}), samples {args.min_len}-{args.max_len} "
        f"tokens, {args.warmup} warm-up steps left out"
    )
    print(f"{'run':24} {'steps':>6} {'tok/step':>9} {'tok/s':>9} {'peak GiB':>9} {'data wait':>10}")
    for label, key in (
        ("speculators (1 GPU)", "speculators"),
        ("eyrie (1 process)", "eyrie"),
        (f"eyrie (1 proc, x{2 * args.packs_per_step} packs)", "eyrie_1x"),
        ("eyrie (2 processes)", "eyrie_2"),
    ):
        r = runs.get(key)
        if r:
            print(
                f"{label:24} {r['measured_steps']:>6} {r['tokens_per_step']:>9.0f} "
                f"{r['tokens_per_s']:>9.0f} {gib(r['peak_memory_bytes']):>9} "
                f"{100 * r['data_wait_fraction']:>9.1f}%"
            )
    if spec_note:
        print(f"speculators: {spec_note}")
    if ratios:
        pm = ratios["peak_memory"]
        print(
            f"eyrie / speculators: tokens/s {ratios['tokens_per_s']:.2f}x (goal >= 1.2), "
            "peak memory "
            f"{'n/a' if pm is None else f'{pm:.2f}x'} (goal <= 1.0)"
        )
    print(f"eyrie data wait {100 * e['data_wait_fraction']:.1f}% of step time (goal < 5%)")
    if scaling is not None:
        same = "identical" if parity["weights_identical"] else "not identical"
        print(
            f"eyrie 2 processes / 1: {scaling:.2f}x tokens/s (goal >= 1.8); "
            "final weights max |diff| "
            f"{parity['weights_max_abs_diff']:.3g} ({same}), losses max |diff| "
            f"{parity['loss_max_abs_diff']}"
        )
    print("phases (s): " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))

    machine = name.split()[-1].lower() if cuda else device
    name_ = f"training-{'tiny-' if args.tiny else ''}{machine}.json"
    out = args.out or REPO / "benchmarks" / "results" / name_
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": str(date.today()),
                "device": name,
                "torch": torch.__version__,
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                "shape": shape,
                "ttt_steps": TTT_STEPS,
                "tokens_per_step_budget": budget,
                "eyrie_settings": {
                    "max_tokens_per_batch": args.max_tokens,
                    "packs_per_step": args.packs_per_step,
                },
                "warmup_steps": args.warmup,
                "samples": len(samples),
                "sample_tokens": tokens,
                "conversion_check": check,
                "speculators": spec_note or "run",
                "speculators_cpu_check": spec_check,
                "speculators_settings": spec_settings,
                "runs": runs,
                "ratios": ratios,
                "scaling_2_gpus": scaling,
                "parity_1_vs_2": parity,
                "goals": goals,
                "phases_s": phases,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""The draft's training step alone on one GPU, in variants (attention, pack size, optimizer), and
whether it repeats bit for bit: what eyrie's GPU training defaults rest on (BENCHMARKS.md, "Draft
training on one GPU").

The draft is the training benchmark's (speculators' Eagle3DraftModel: 1 layer, hidden 4096,
target vocab 128,256, draft vocab 32,000, 3 TTT steps; target folder from
benchmarks/training_gpu.py's build_target), trained as `eyrie train` does on a GPU: bf16 autocast,
kl_div loss (eager), gradient clipping, AdamW. Batches are random, packed from documents of
1,023-2,047 tokens with 2 padding positions after each and the tail padded (document id -1).

    python benchmarks/train_step_gpu.py time attn=sdpa,T=4096 attn=flex,T=4096 \
        attn=flex,T=8192,packs=1
    python benchmarks/train_step_gpu.py repeat

time: one process per variant (keys: attn=sdpa|flex, T=tokens per pack, packs=per step (2),
fused=1 for fused AdamW, prof=1 to write a CUDA kernel profile of one more step to $OUT or /tmp).
Variants compile at the same time and are timed one at a time (a file lock): 3 warm-up steps,
then 10 timed steps. Prints one JSON line per variant: s/step, real tokens/s, peak memory.
repeat: the same 8 steps (flex, one 8,192-token pack) twice from the same seed in one process,
then twice more under torch.use_deterministic_algorithms; prints the largest weight and loss
differences. Needs CUDA (FlexAttention has no backward on a CPU); `--tiny` (first argument) runs
`time` on small shapes and documents on the CPU with sdpa, a check that the script works.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
WORK = Path(
    os.environ.get("EYRIE_BENCH_WORK")
    or Path(os.environ.get("TMPDIR", "/tmp")) / "eyrie-train-step-bench"
)
OUT = Path(os.environ.get("OUT", "/tmp"))
ATTN = {"sdpa": "sdpa", "flex": "simple_flex_attention"}
TINY = "--tiny" in sys.argv  # small shapes on the CPU: a check of the script
DEVICE = "cpu" if TINY else "cuda"
DOC_TOKENS = (16, 64) if TINY else (1023, 2048)  # document lengths, [low, high)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def setup():
    """The full training-benchmark shape, its target folder (built once) and a vocabulary map."""
    from training_gpu import SHAPES, build_target

    from eyrie.data.vocab import vocab_mappings

    shape = SHAPES["tiny" if TINY else "full"]
    if not (WORK / "target" / "model.safetensors").exists():
        build_target(WORK / "target", shape, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(shape["vocab"], generator=g)[: shape["draft_vocab"]].sort().values
    return shape, vocab_mappings(ids.numpy(), shape["vocab"])


def build(shape, d2t, t2d, attn: str):
    """The draft as `eyrie train` builds it (eyrie.arch.draft.build_draft, seed 0), on the
    device."""
    from eyrie.arch.draft import DraftSpec, build_draft

    spec = DraftSpec(shape["aux"], num_layers=1, ttt_steps=3, attn_impl=attn)
    model = build_draft(WORK / "target", spec, d2t, t2d, seed=0)
    return model.to(DEVICE).train()


def batch(shape, T: int, seed: int) -> tuple[dict[str, torch.Tensor], int]:
    """A packed batch of T positions (each value [1, T, ...]) on the GPU, and its real tokens."""
    g = torch.Generator().manual_seed(seed)
    H, A = shape["hidden"], len(shape["aux"])
    doc = torch.full((T,), -1, dtype=torch.long)
    pos = torch.zeros(T, dtype=torch.long)
    mask = torch.zeros(T, dtype=torch.bool)
    p, d, real = 0, 0, 0
    while True:
        n = int(torch.randint(*DOC_TOKENS, (1,), generator=g))
        if p + n + 2 > T:
            break
        doc[p : p + n], pos[p : p + n] = d, torch.arange(1, n + 1)
        mask[p + int(0.4 * n) : p + n - 1] = True
        p, d, real = p + n + 2, d + 1, real + n
    b = {
        "hidden_states": torch.randn(1, T, A * H, generator=g).to(torch.bfloat16),
        "verifier_last_hidden_states": torch.randn(1, T, H, generator=g).to(torch.bfloat16),
        "input_ids": torch.randint(0, shape["vocab"], (1, T), generator=g),
        "loss_mask": mask[None],
        "position_ids": pos[None],
        "document_ids": doc[None],
    }
    return {k: v.to(DEVICE) for k, v in b.items()}, real


def trainer(model, batches, packs: int, fused: bool, lr: float):
    """step(i) -> real tokens: eyrie's GPU step over `packs` packs of `batches` (cycled)."""
    from speculators.losses import resolve_loss_config

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=fused)
    loss_config = resolve_loss_config("kl_div", "eager")
    losses: list[torch.Tensor] = []

    def step(i: int) -> int:
        opt.zero_grad(set_to_none=True)
        tokens = 0
        for j in range(packs):
            b, real = batches[(i * packs + j) % len(batches)]
            tokens += real
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                _, loss, _ = model(
                    **b, ttt_steps=3, ttt_step_loss_decay=1.0, loss_config=loss_config
                )
            (loss / packs).backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return tokens

    return step, losses


def time_variant(variant: str) -> None:
    opts = dict(kv.split("=") for kv in variant.split(","))
    T, packs = int(opts.get("T", 4096)), int(opts.get("packs", 2))
    shape, (d2t, t2d) = setup()
    model = build(shape, d2t, t2d, ATTN[opts.get("attn", "sdpa")])
    step, _ = trainer(
        model, [batch(shape, T, s) for s in range(4)], packs, opts.get("fused") == "1", 1e-4
    )
    t0 = time.perf_counter()
    for i in range(3):
        step(i)
    sync()
    warm = time.perf_counter() - t0
    with open(WORK / "lock", "w") as lock:  # one variant timed at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        tokens = sum(step(i) for i in range(3, 13))
        sync()
        dt = time.perf_counter() - t0
        print(
            json.dumps(
                {
                    "variant": variant,
                    "warm_s": round(warm, 1),
                    "s_per_step": dt / 10,
                    "tok_s": tokens / dt,
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30
                    if DEVICE == "cuda"
                    else None,
                }
            ),
            flush=True,
        )
        if opts.get("prof") == "1":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step(13)
                sync()
            name = variant.replace(",", "_").replace("=", "")
            (OUT / f"prof_{name}.txt").write_text(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            )


def repeat() -> None:
    shape, (d2t, t2d) = setup()
    batches = [batch(shape, 8192, s) for s in range(4)]

    def once(deterministic: bool):
        torch.use_deterministic_algorithms(deterministic)
        model = build(shape, d2t, t2d, ATTN["flex"])
        step, losses = trainer(model, batches, 1, False, 3e-3)
        for i in range(8):
            step(i)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, [
            float(x) for x in losses
        ]

    def diff(a, b) -> dict:
        return {
            "weights_max_abs_diff": max(
                float((a[0][k].double() - b[0][k].double()).abs().max()) for k in a[0]
            ),
            "loss_max_abs_diff": max(abs(x - y) for x, y in zip(a[1], b[1])),
        }

    r1, r2 = once(False), once(False)
    print(json.dumps({"repeat": diff(r1, r2)}), flush=True)
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    d1, d2 = once(True), once(True)
    print(
        json.dumps(
            {"deterministic_repeat": diff(d1, d2), "deterministic_vs_default": diff(d1, r1)}
        ),
        flush=True,
    )


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--tiny"]
    if not TINY and not torch.cuda.is_available():
        raise SystemExit(
            "train_step_gpu.py needs a CUDA device (FlexAttention has no backward on a "
            "CPU); --tiny checks the script on the CPU"
        )
    WORK.mkdir(parents=True, exist_ok=True)
    mode, rest = (args[0], args[1:]) if args else ("", [])
    if mode == "time" and TINY and any("flex" in v for v in rest):
        raise SystemExit("--tiny runs on the CPU: attn=sdpa only")
    if mode == "time" and len(rest) == 1:
        time_variant(rest[0])
    elif mode == "time" and rest:
        setup()  # the target folder once, before the variants start
        procs = [
            subprocess.Popen([sys.executable, __file__, *(["--tiny"] if TINY else []), "time", v])
            for v in rest
        ]
        sys.exit(max(p.wait() for p in procs))
    elif mode == "repeat" and not rest and not TINY:
        repeat()
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()

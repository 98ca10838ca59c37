"""A tiny world for the train/export tests: a 4-layer Llama target with a chat tokenizer, its
real hidden states in HDF5 shards, a draft vocabulary map and a preflight report."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file, save_file

from eyrie.arch.hooks import capture_hidden_states
from eyrie.arch.target import fingerprint, read_config, tokenizer_hash
from eyrie.demo.tokenizer import build_chat_tokenizer
from eyrie.formats.hidden import ShardMeta
from eyrie.formats.hidden_writer import ShardWriter
from tests.support.models import random_model, save_target, tiny_llama
from tests.support.stages import stage_args

AUX_IDS, FINAL_ID, HIDDEN, DRAFT_VOCAB = [1, 2, 3], 4, 32, 96

WORDS = (
    "the cat dog sat ran on a mat log red blue big small fast slow and then it was very "
    "happy sad old new tree house car"
).split()


def conversations(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
        # A predictable answer: the question's words repeated in order (a pattern to learn).
        a = " ".join(q.split() * 2)
        out.append([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
    return out


def train_settings(**overrides) -> dict:
    train = dict(
        seed=0,
        device="cpu",
        epochs=2,
        learning_rate=1e-2,
        weight_decay=0.0,
        warmup_steps=2,
        max_grad_norm=1.0,
        max_tokens_per_batch=128,
        ttt_steps=3,
        ttt_step_loss_decay=1.0,
        num_layers=1,
        draft_arch="llama",
        norm_before_residual=True,
        checkpoint_every=100,
        log_every=5,
    )
    train.update(overrides)
    return {"train": train}


def build_world(root: Path, num_conversations: int = 24, shards: int = 2) -> dict:
    """Target folder, preflight.json, vocab.safetensors and hidden-state shards under `root`."""
    texts = [m["content"] for conv in conversations(200, 1) for m in conv]
    tok = build_chat_tokenizer(texts, 300)
    config = tiny_llama(len(tok), tok, hidden_size=HIDDEN, max_position_embeddings=512)
    model = random_model(config).eval()
    target = save_target(root / "target", model, tok)

    samples = []
    for conv in conversations(num_conversations, 2):
        prompt = tok.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(conv, tokenize=False)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = tok(full, add_special_tokens=False)["input_ids"]
        # assistant tokens incl. the turn's <|end|>, not the trailing newline
        mask = [0] * len(p_ids) + [1] * (len(ids) - len(p_ids) - 1) + [0]
        samples.append((ids, mask))

    counts = torch.zeros(len(tok), dtype=torch.long)
    for ids, mask in samples:
        for t, m in zip(ids, mask):
            counts[t] += m
    keep = torch.sort(torch.argsort(counts, descending=True, stable=True)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(len(tok), dtype=torch.bool)
    t2d[keep] = True
    d2t = keep - torch.arange(DRAFT_VOCAB)
    vocab = root / "vocab.safetensors"
    save_file({"d2t": d2t, "t2d": t2d}, str(vocab))

    target_fp, tok_hash = fingerprint(read_config(target)), tokenizer_hash(target)
    preflight = root / "preflight.json"
    preflight.write_text(
        json.dumps(
            {
                "ok": True,
                "target": {
                    "path": str(target),
                    "model_type": "llama",
                    "num_hidden_layers": 4,
                    "hidden_size": HIDDEN,
                    "vocab_size": len(tok),
                    "fingerprint": target_fp,
                    "tokenizer_hash": tok_hash,
                },
                "aux_layer_ids": AUX_IDS,
                "final_layer_id": FINAL_ID,
            }
        )
    )
    meta = dict(
        target_fingerprint=target_fp,
        tokenizer_hash=tok_hash,
        aux_layer_ids=AUX_IDS,
        final_layer_id=FINAL_ID,
        hidden_size=HIDDEN,
    )
    shard_paths = []
    for s in range(shards):
        part = samples[s::shards]
        path = root / f"shard_{s:03d}.h5"
        write_shard(
            path,
            model,
            part,
            ShardMeta(**meta),
            [f"conv.jsonl:{s + 1 + shards * i}" for i in range(len(part))],
        )
        shard_paths.append(path)
    return {
        "target": target,
        "preflight": preflight,
        "vocab": vocab,
        "shards": shard_paths,
        "meta": meta,
        "model": model,
        "samples": samples,
        "tokenizer": tok,
    }


def write_shard(path: Path, model, samples, meta: ShardMeta, sample_ids: list[str]) -> None:
    """Real hidden states of `model` (vLLM layer-id semantics via eyrie.arch.hooks)."""
    ids_list, masks = [s[0] for s in samples], [s[1] for s in samples]
    with ShardWriter(path, meta, sample_ids, ids_list, masks) as writer, torch.no_grad():
        for i, ids in enumerate(ids_list):
            with capture_hidden_states(model, meta.aux_layer_ids + [meta.final_layer_id]) as cap:
                model(torch.tensor([ids]))
            aux = torch.cat([cap[k][0] for k in meta.aux_layer_ids], dim=-1)  # [T, n_aux*H]
            writer.put(i, aux, cap[meta.final_layer_id][0])


def save_chat_target(path: Path, texts: list[str], vocab_size: int = 320, **llama) -> Path:
    """A complete tiny Llama target folder (random weights, chat tokenizer) built from `texts`;
    `llama` overrides LlamaConfig fields (8 layers, hidden 32 by default)."""
    tok = build_chat_tokenizer(texts, vocab_size)
    shape = {"num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1}
    return save_target(path, random_model(tiny_llama(len(tok), **{**shape, **llama})), tok)


def write_eval_set(path: Path, prompts: list[list[int]]) -> Path:
    """An eval.parquet as `eyrie tokenize` writes it, holding only these prompts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table(
            {
                "sample_id": [f"conv.jsonl:{i + 1}" for i in range(len(prompts))],
                "input_ids": pa.array(prompts, type=pa.list_(pa.int32())),
                "loss_mask": pa.array([[0] * len(p) for p in prompts], type=pa.list_(pa.uint8())),
                "prompt_ids": pa.array(prompts, type=pa.list_(pa.int32())),
            }
        ),
        path,
    )
    return path


def write_preflight(
    path: Path, target: Path, aux_ids: list[int], hidden_size: int, vocab_size: int
) -> Path:
    """A passing preflight.json for a 4-layer Llama target (what read_report checks)."""
    path.write_text(
        json.dumps(
            {
                "ok": True,
                "aux_layer_ids": aux_ids,
                "final_layer_id": 4,
                "target": {
                    "path": str(target),
                    "model_type": "llama",
                    "num_hidden_layers": 4,
                    "hidden_size": hidden_size,
                    "vocab_size": vocab_size,
                    "fingerprint": fingerprint(read_config(target)),
                    "tokenizer_hash": tokenizer_hash(target),
                },
            }
        )
    )
    return path


def train_paths(world: dict, root: Path, shards: list[Path] | None = None):
    """TrainPaths of a run on `world` (its shards unless `shards`) with its run folder root/train
    and state root/state."""
    from eyrie.train.inputs import TrainPaths

    return TrainPaths(
        world["target"],
        world["preflight"],
        world["vocab"],
        world["shards"] if shards is None else shards,
        root / "train",
        root / "state",
    )


# DDP runs: 4 packs per step, so each of 2 ranks accumulates 2 packs (no_sync on the first).
DDP = dict(epochs=4, packs_per_step=4, checkpoint_every=2, log_every=4)
# 2 ranks x 2 packs against 1 process x 4 packs: the gradient sum is associated as (g0+g1)+(g2+g3)
# instead of ((g0+g1)+g2)+g3, a few float32 ulps that Adam carries on (docs/training.md); with one
# pack per rank the weights are bitwise equal. The tolerance leaves about 10x headroom.
RTOL, ATOL = 2e-5, 3e-6


def train_args(
    world: dict, root: Path, settings: dict, shards: list[Path] | None = None, state: str = "state"
) -> list[str]:
    """`train ...` on `world` (its shards unless `shards`) into root/train, checkpoints in
    root/`state`: the argv of eyrie.cli.main."""
    return stage_args(
        "train",
        target=world["target"],
        preflight=world["preflight"],
        vocab=world["vocab"],
        shards=world["shards"] if shards is None else shards,
        out_dir=root / "train",
        state_dir=root / state,
        settings=settings,
    )


def eyrie_train(
    world: dict, root: Path, settings: dict, *extra: str, threads: int = 2
) -> list[str]:
    """`python -m eyrie train ...`; --threads is the node's (under torchrun: 1 per rank)."""
    head = [sys.executable, "-m", "eyrie", "--threads", str(threads)]
    return [*head, *train_args(world, root, settings), *extra]


def run_eyrie(cmd: list[str], cwd: Path):
    """`cmd` run to its end in `cwd` (at most 4 minutes): the CompletedProcess."""
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240)


def weights(root: Path) -> dict[str, torch.Tensor]:
    """The trained draft's tensors of the run in `root`."""
    return load_file(str(root / "train" / "draft" / "model.safetensors"))


def cut_and_resumed(world: dict, root: Path, settings: dict, cut_at: int = 6):
    """(weights of an uninterrupted run, weights of a run stopped after `cut_at` steps and
    resumed from its last checkpoint), both on `world` under `root`."""
    from eyrie.train.recipe import train

    train(train_paths(world, root / "full"), settings)
    assert train(train_paths(world, root / "cut"), settings, stop_after_steps=cut_at) is None
    train(train_paths(world, root / "cut"), settings)  # resumes from its checkpoint
    return weights(root / "full"), weights(root / "cut")


def evaluate_on(world: dict, draft: Path, root: Path, settings: dict, prompts: int) -> dict:
    """`eyrie evaluate` of the exported `draft` on the first `prompts` samples of `world`, each
    cut after its assistant header (what a user sends): its eval.json under `root`."""
    from eyrie.cli import main as cli_main

    start = world["tokenizer"].convert_tokens_to_ids("<|start|>")
    cut = [ids[: ids.index(start, 2) + 3] for ids, _ in world["samples"][:prompts]]
    report = root / "eval.json"
    argv = stage_args(
        "evaluate",
        target=world["target"],
        draft=draft,
        vocab=world["vocab"],
        eval_set=write_eval_set(root / "eval.parquet", cut),
        preflight=world["preflight"],
        out=report,
        plot=root / "eval.png",
        settings=settings,
    )
    assert cli_main(argv) == 0
    return json.loads(report.read_text())


def assert_weights(a: dict, b: dict, exact: bool) -> None:
    """The same tensors: bitwise with `exact`, else within DDP's float32 sum order."""
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=k)


BLOCK = 4  # the block drafters' block in tests


def block_draft(world, method: str, seed: int = 0, attn: str = "sdpa"):
    """A DFlash or DSpark draft (eyrie.arch.draft) for `world`'s target, blocks of BLOCK; the
    tiny tokenizer has no mask token and no free embedding row, so its pad token masks."""
    from eyrie.arch.draft import DraftSpec, build_draft
    from eyrie.formats.vocab import read_vocab

    d2t, t2d = read_vocab(world["vocab"])
    pad = world["tokenizer"].pad_token_id
    spec = DraftSpec(AUX_IDS, method=method, block_size=BLOCK, mask_token_id=pad, attn_impl=attn)
    return build_draft(world["target"], spec, d2t, t2d, seed=seed)


def start_and_kill(cmd: list[str], root: Path, at_step: int) -> str:
    """Start `cmd`, SIGKILL it and every process under it (torchrun's workers run in their own
    sessions) as soon as the checkpoint of `at_step` exists; the log."""
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "killed.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT)
    deadline, killed = time.monotonic() + 240, False
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if list((root / "state").glob(f"*/step_{at_step:08d}")):
                for p in [proc, *psutil.Process(proc.pid).children(recursive=True)]:
                    p.kill()  # SIGKILL: no handler runs, as when a node dies
                killed = True
                break
            time.sleep(0.005)
    finally:
        proc.kill()
        proc.wait()
    log = log_path.read_text()
    assert killed and proc.returncode == -signal.SIGKILL, log
    return log


def metrics(root: Path) -> list[dict]:
    return [json.loads(ln) for ln in (root / "train" / "metrics.jsonl").read_text().splitlines()]

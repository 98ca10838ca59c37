"""Build and train the embedded demo target: a small Llama trained on CPU on the demo conversations.

Steps: train a byte-level BPE with a chat template on the conversation texts
(`eyrie.demo.tokenizer`), render every conversation with that template, pack the token stream into
`seq_len` windows, train a Llama from scratch with AdamW and a warmup + cosine schedule, and save a
Hugging Face model folder (config.json, model.safetensors, tokenizer files, demo_training.json)
atomically. Same seed and settings on the same machine give identical weights.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from eyrie.config.stages import DemoTargetSettings
from eyrie.core.errors import DemoError
from eyrie.core.io import atomic_path, provenance, write_json
from eyrie.core.runtime import auto_device
from eyrie.demo.corpus import read_conversations
from eyrie.demo.tokenizer import build_chat_tokenizer

log = logging.getLogger(__name__)

MAX_POSITION_EMBEDDINGS = 4096  # well above any demo sequence (data.max_seq_len, eval prompts)
HELD_OUT_FRACTION = 0.02  # conversations kept out of training for the held-out loss
MAX_EVAL_WINDOWS = 16
LOG_EVERY = 10
SAMPLE_NEW_TOKENS = 64


def num_threads() -> int:
    """CPU cores this process may use (the affinity mask, not the whole host)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def build_config(demo: DemoTargetSettings, tokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=demo.hidden_size,
        intermediate_size=demo.intermediate_size,
        num_hidden_layers=demo.num_hidden_layers,
        num_attention_heads=demo.num_attention_heads,
        num_key_value_heads=demo.num_key_value_heads,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )


def tokenize_conversations(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """Render each conversation with the chat template and tokenize it (template adds BOS)."""
    texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in conversations]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def pack(token_lists: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate and cut into full windows: int64 [num_windows, seq_len] (remainder dropped)."""
    stream = [t for ids in token_lists for t in ids]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.int64).view(n, seq_len)


def lr_factor(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warmup to 1, then cosine decay to `floor` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def held_out_loss(model, token_lists: list[list[int]], seq_len: int) -> float | None:
    """Token-weighted mean loss on held-out conversations, in windows of at most seq_len."""
    stream = [t for ids in token_lists for t in ids][: MAX_EVAL_WINDOWS * seq_len]
    total, count = 0.0, 0
    model.eval()
    for start in range(0, len(stream), seq_len):
        chunk = stream[start : start + seq_len]
        if len(chunk) < 2:
            break
        ids = torch.tensor([chunk], device=model.device)  # [1, T] int64
        total += model(input_ids=ids, labels=ids).loss.item() * (len(chunk) - 1)
        count += len(chunk) - 1
    model.train()
    return total / count if count else None


@torch.no_grad()
def greedy_sample(
    model, tokenizer, messages: list[dict], max_new_tokens: int = SAMPLE_NEW_TOKENS
) -> str:
    """Greedy answer to the first user turn of `messages` (with any system message before it)."""
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    prompt = tokenizer.apply_chat_template(
        messages[: first_user + 1], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor(
        [tokenizer(prompt, add_special_tokens=False)["input_ids"]], device=model.device
    )  # [1, T]
    model.eval()
    out = model.generate(
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.train()
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@dataclass(frozen=True)
class DemoData:
    """The conversations, the tokenizer trained on them, and the training windows."""

    conversations: list[list[dict]]
    tokenizer: object  # PreTrainedTokenizerFast
    token_lists: list[list[int]]  # one per conversation
    held_idx: list[int]  # conversations kept out of training
    train_idx: list[int]
    windows: torch.Tensor  # [W, seq_len] int64
    num_tokens: int  # training tokens before packing


@dataclass(frozen=True)
class DemoTraining:
    """The model and what steps it."""

    model: LlamaForCausalLM
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def prepare_data(
    conversations_path: str | Path, demo: DemoTargetSettings, threads: int
) -> DemoData:
    """Train the tokenizer, split off the held-out conversations, tokenize and pack the rest."""
    seed, seq_len = demo.seed, demo.seq_len
    conversations = read_conversations(conversations_path)
    tokenizer = build_chat_tokenizer(
        (text for conv in conversations for m in conv for text in (m["role"], m["content"])),
        demo.vocab_size,
    )
    if len(tokenizer) < demo.vocab_size:
        log.info(
            "BPE stopped at %d tokens (< demo.vocab_size=%d): the texts have no more merges",
            len(tokenizer),
            demo.vocab_size,
        )
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    n_held = max(1, round(HELD_OUT_FRACTION * len(order))) if len(order) > 1 else 0
    held_idx, train_idx = order[:n_held], order[n_held:]
    token_lists = tokenize_conversations(tokenizer, conversations)
    windows = pack([token_lists[i] for i in train_idx], seq_len)  # [W, seq_len] int64
    if len(windows) == 0:
        raise DemoError(
            f"{conversations_path}: fewer than demo.seq_len={seq_len} training "
            "tokens; raise demo.num_conversations or lower demo.seq_len"
        )
    num_tokens = sum(len(token_lists[i]) for i in train_idx)
    log.info(
        "%d conversations (%d held out), %d training tokens -> %d windows of %d; vocab %d; "
        "%d threads",
        len(conversations),
        n_held,
        num_tokens,
        len(windows),
        seq_len,
        len(tokenizer),
        threads,
    )
    return DemoData(conversations, tokenizer, token_lists, held_idx, train_idx, windows, num_tokens)


def build_training(demo: DemoTargetSettings, tokenizer, device: str = "cpu") -> DemoTraining:
    """A Llama from scratch (seeded with demo.seed) on `device`, AdamW and the warmup + cosine
    schedule."""
    steps = demo.train_steps
    torch.manual_seed(demo.seed)
    model = LlamaForCausalLM(build_config(demo, tokenizer)).to(device)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=demo.learning_rate, betas=(0.9, 0.95), weight_decay=0.01
    )
    warmup = max(1, min(100, steps // 10))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup, steps))
    return DemoTraining(model, optimizer, scheduler)


def train_steps(
    training: DemoTraining, windows: torch.Tensor, demo: DemoTargetSettings
) -> list[dict]:
    """demo.train_steps steps over shuffled windows (reshuffled when they run out); returns the
    loss curve (a point every LOG_EVERY steps and at the last)."""
    model, optimizer = training.model, training.optimizer
    seed, steps = demo.seed, demo.train_steps
    gen = torch.Generator().manual_seed(seed)
    perm, cursor = torch.randperm(len(windows), generator=gen), 0
    curve, t_log, tokens_since = [], time.perf_counter(), 0
    batch_size = min(demo.batch_size, len(windows))
    for step in range(steps):
        if cursor + batch_size > len(perm):
            perm, cursor = torch.randperm(len(windows), generator=gen), 0
        batch = windows[perm[cursor : cursor + batch_size]].to(model.device)  # [B, seq_len]
        cursor += batch_size
        loss = model(input_ids=batch, labels=batch).loss
        if not torch.isfinite(loss):
            raise DemoError(
                f"demo target loss became {loss.item()} at step {step}; lower demo.learning_rate"
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        training.scheduler.step()
        tokens_since += batch.numel()
        if step % LOG_EVERY == 0 or step == steps - 1:
            now = time.perf_counter()
            tps = tokens_since / max(now - t_log, 1e-9)
            t_log, tokens_since = now, 0
            lr = optimizer.param_groups[0]["lr"]
            curve.append(
                {
                    "step": step + 1,
                    "loss": round(loss.item(), 4),
                    "lr": lr,
                    "tokens_per_s": round(tps, 1),
                }
            )
            log.info(
                "step %d/%d loss %.4f lr %.2e %.0f tok/s", step + 1, steps, loss.item(), lr, tps
            )
    return curve


def held_out(model, data: DemoData, seq_len: int) -> tuple[float | None, dict | None]:
    """(held-out loss, a greedy answer to the first held-out conversation); None without any."""
    held = [data.token_lists[i] for i in data.held_idx]
    if not held:
        return None, None
    eval_loss = held_out_loss(model, held, seq_len)
    messages = data.conversations[data.held_idx[0]]
    return eval_loss, {
        "messages": messages,
        "greedy_answer": greedy_sample(model, data.tokenizer, messages),
    }


def train_target(conversations_path: str | Path, out_dir: str | Path, settings: dict) -> dict:
    """Build, train and save the demo target; return the training summary (demo_training.json)."""
    demo = DemoTargetSettings.from_settings(settings)
    t0 = time.perf_counter()
    threads = num_threads()
    torch.set_num_threads(threads)
    data = prepare_data(conversations_path, demo, threads)
    device = auto_device("demo.device", demo.device, DemoError)
    training = build_training(demo, data.tokenizer, device)
    model, tokenizer = training.model, data.tokenizer
    num_params = sum(p.numel() for p in model.parameters())
    curve = train_steps(training, data.windows, demo)
    train_wall = time.perf_counter() - t0
    eval_loss, sample = held_out(model, data, demo.seq_len)
    summary = {
        "settings": asdict(demo),  # as the stage read them
        "vocab_size": len(tokenizer),
        "ln_vocab": math.log(len(tokenizer)),
        "num_parameters": num_params,
        "num_conversations": len(data.conversations),
        "num_held_out": len(data.held_idx),
        "num_train_tokens": data.num_tokens,
        "num_windows": len(data.windows),
        "threads": threads,
        "device": device,
        "loss_curve": curve,
        "final_loss": curve[-1]["loss"] if curve else None,
        "held_out_loss": eval_loss,
        "sample": sample,
        "train_wall_s": round(train_wall, 2),
        "provenance": provenance(settings),
    }
    log.info(
        "trained in %.1f s: final loss %s, held-out loss %s (ln vocab = %.3f)",
        train_wall,
        summary["final_loss"],
        None if eval_loss is None else round(eval_loss, 4),
        summary["ln_vocab"],
    )
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)  # config.json, generation_config.json, model.safetensors
        tokenizer.save_pretrained(tmp)  # tokenizer.json, tokenizer_config.json, chat template
        # what the workflow checks at each parse: weights replaced by hand are named
        summary["weights_digest"] = weights_digest(tmp)
        write_json(tmp / "demo_training.json", summary)
        _validate_folder(tmp, model)
    log.info("saved the demo target to %s", out_dir)
    return summary


def weights_digest(folder: Path) -> str:
    """model.safetensors by content (eyrie.store.fingerprint's digest: sampled when large)."""
    from eyrie.store.fingerprint import file_digest

    path = Path(folder) / "model.safetensors"
    return file_digest(path, path.stat().st_size)


def _validate_folder(path: Path, model) -> None:
    """Reload the saved folder with the Auto classes and compare one weight."""
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    if not tok.chat_template:
        raise DemoError(f"{path}: saved tokenizer has no chat template")
    if not torch.equal(reloaded.lm_head.weight, model.lm_head.weight.cpu()):
        raise DemoError(f"{path}: reloaded weights differ from the trained ones")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--conversations",
        required=True,
        type=Path,
        help="conversations.jsonl written by `eyrie demo-conversations`",
    )
    parser.add_argument("--out-dir", required=True, type=Path, help="model folder to write")


def run(args: argparse.Namespace) -> int:
    train_target(args.conversations, args.out_dir, args.settings)
    return 0

"""A rehearsal's stand-in for the target's weights (docs/rehearsal.md): random embedding and
lm_head rows of the target's shapes and a final norm of ones, which training, the export and its
check read through speculators' loader instead of the target's files (a rehearsal's target may
have none yet). The rows are the same at every load and whatever the number of CPU threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# torch.nn.init's normal std for embeddings when a config gives no initializer_range
INIT_STD = 0.02
RANDOM_VERIFIER_SEED = 0
ROW_ORDER = ("embed_tokens.weight", "lm_head.weight", "model.norm.weight")  # drawn in this order
# rows of a random table drawn from one generator: the blocks are drawn by torch's CPU threads
# at once, each from its own seed, so the table is the same whatever the number of threads;
# block b of the table seeded s has seed s * SEED_BLOCKS + b (the CPU generator keeps 32 bits)
ROW_BLOCK, SEED_BLOCKS = 4096, 2**16


def random_rows(rows: int, cols: int, std: float, seed: int) -> torch.Tensor:
    """[rows, cols] float32 of N(0, std): block b (ROW_BLOCK rows) from a generator seeded
    `seed` * SEED_BLOCKS + b, the blocks drawn on torch.get_num_threads() threads (normal_
    releases the GIL; one generator alone fills a [163840, 7168] table in seconds on one core)."""
    from concurrent.futures import ThreadPoolExecutor

    if rows > ROW_BLOCK * SEED_BLOCKS:
        raise ValueError(f"{rows} rows: random_rows draws at most {ROW_BLOCK * SEED_BLOCKS}")
    out = torch.empty(rows, cols, device="cpu")  # its generators are CPU ones, on any device

    def fill(block: int) -> None:
        g = torch.Generator().manual_seed(seed * SEED_BLOCKS + block)
        out[block * ROW_BLOCK : (block + 1) * ROW_BLOCK].normal_(0, std, generator=g)

    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        list(pool.map(fill, range(-(-rows // ROW_BLOCK))))
    return out


@contextmanager
def random_verifier_weights(verifier) -> Iterator[None]:
    """A rehearsal's stand-in for the target's weights, which it need not have on disk:
    speculators reads the verifier's embed_tokens, lm_head and final norm with
    speculators.utils.loading.load_model_layers; within this block that gives random rows of
    `verifier`'s (a text config's) shapes [vocab_size, hidden_size] (the norm: ones) instead."""
    import speculators.utils.loading as loading

    vocab, hidden = int(verifier.vocab_size), int(verifier.hidden_size)
    std = float(getattr(verifier, "initializer_range", None) or INIT_STD)
    first = 2 * RANDOM_VERIFIER_SEED  # the embedding's seed; the lm_head's is the next

    def random_layers(names: list[str], model_path: str) -> dict[str, torch.Tensor]:
        # the same rows at every load (training, export, its check): one stand-in target, drawn
        # once per process and copied to each load
        rows = drawn.get(tuple(names))
        if rows is None:
            table = {
                "embed_tokens.weight": lambda: random_rows(vocab, hidden, std, seed=first),
                "lm_head.weight": lambda: random_rows(vocab, hidden, std, seed=first + 1),
                "model.norm.weight": lambda: torch.ones(hidden, device="cpu"),
            }
            rows = drawn[tuple(names)] = {n: table[n]() for n in ROW_ORDER if n in names}
        return {name: t.clone() for name, t in rows.items()}

    drawn: dict[tuple, dict[str, torch.Tensor]] = {}

    stored = loading.load_model_layers
    loading.load_model_layers = random_layers
    try:
        yield
    finally:
        loading.load_model_layers = stored

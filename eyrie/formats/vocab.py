"""The vocabulary map's reader: vocab.safetensors (`d2t`, `t2d`) as `eyrie vocab` writes it.

`read_vocab` refuses a map whose tensors are missing, of the wrong dtype, or disagree with each
other or with the target's vocab_size, and says to rebuild it. The file: docs/contracts.md#files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from eyrie.core.errors import VocabError


def read_vocab(
    path: str | Path, target_vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft_vocab], t2d bool [target_vocab]) from vocab.safetensors, cross-checked;
    with `target_vocab`, t2d must cover exactly that many target ids."""
    path = Path(path)
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for a bad file
        raise VocabError(
            f"{path}: cannot read the vocabulary map ({exc}); rerun `eyrie vocab`"
        ) from exc
    for name, dtype in (("d2t", torch.int64), ("t2d", torch.bool)):
        if name not in tensors or tensors[name].dtype != dtype or tensors[name].dim() != 1:
            raise VocabError(f"{path}: needs a 1-d {dtype} tensor {name!r}; rerun `eyrie vocab`")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if target_vocab is not None and t2d.shape != (target_vocab,):
        raise VocabError(
            f"{path}: t2d has shape {tuple(t2d.shape)} but the target's vocab_size "
            f"is {target_vocab}; rebuild the vocabulary map for this target"
        )
    mapped = torch.arange(len(d2t)) + d2t
    if (
        len(d2t) == 0
        or mapped.min() < 0
        or mapped.max() >= len(t2d)
        or not torch.equal(torch.sort(mapped).values, torch.nonzero(t2d).flatten())
    ):
        raise VocabError(
            f"{path}: d2t and t2d disagree (i + d2t[i] must list exactly the "
            "tokens t2d marks); rerun `eyrie vocab`"
        )
    return d2t, t2d

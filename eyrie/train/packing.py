"""The data path of draft training: the alignment of a sample, packing, the plan, loading.

Contract: `shift_sample` aligns a sample of T tokens to T-1 EAGLE-3 training positions (the loss
counts at j iff x_{j+2} is an assistant token); `block_sample` keeps a block drafter's T
positions as they are (token t with its own states; the loss counts at t iff x_t is an assistant
token); `pack` fills batches of at most `max_tokens` positions, each
sample followed by ttt_steps - 1 padding positions (document id -1, loss mask 0) so no TTT step
reaches into the next sample; `Plan` (every epoch's packs, shuffled per epoch by the seed) is a
function of the settings and the shards alone; `Prefetcher` builds the coming steps' batches in a
background thread, float8 shards as codes that `decode_batch` decodes on the device.
Alignment, packing and loading: docs/training.md.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from eyrie.core.errors import EyrieError
from eyrie.formats.hidden import ShardReader


def shift_sample(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Align one sample of length T for EAGLE-3 training; every output has length T-1.

    In: input_ids [T] int64, loss_mask [T] bool, aux_hidden [T, n_aux*H], final_hidden [T, H].
    Unshifted, token t has aux states g_t (context x_0..x_t) and final state y_t, whose
    distribution through the target's norm and lm_head predicts x_{t+1}.
    Shifted position j (as speculators' shift_batch) pairs g_j with the embedding of x_{j+1}
    (input_ids[1:], aux[:-1]) and takes its target distribution from y_{j+1} (final[1:]): that
    distribution predicts x_{j+2}. So the loss at j must count iff x_{j+2} is an assistant
    token: loss_mask[j+2], 0 for the last position (x_{T} does not exist). shift_batch uses
    loss_mask[j+1], which drops the first assistant token and trains on the token after the
    turn's end. speculators slices the mask with the targets for later TTT steps
    (align_for_step), so this alignment holds for every step.
    Out: input_ids [T-1], hidden_states [T-1, n_aux*H], verifier_last_hidden_states [T-1, H],
    loss_mask [T-1] bool, position_ids [T-1] (1..T-1, as shift_batch).
    """
    T = sample["input_ids"].shape[0]
    mask = sample["loss_mask"].to(torch.bool)
    return {
        "input_ids": sample["input_ids"][1:],
        "hidden_states": sample["aux_hidden"][:-1],
        "verifier_last_hidden_states": sample["final_hidden"][1:],
        "loss_mask": torch.cat([mask[2:], mask.new_zeros(min(1, T - 1))]),
        "position_ids": torch.arange(1, T, dtype=torch.long),
        # float8 codes read as stored (ShardReader.read(i, torch.uint8)): their per-token scales
        **(
            {
                "hidden_states_scale": sample["aux_scale"][:-1],
                "verifier_last_hidden_states_scale": sample["final_scale"][1:],
            }
            if "aux_scale" in sample
            else {}
        ),
    }


def block_sample(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Align one sample of length T for a block drafter (DFlash, DSpark); outputs of length T.

    speculators trains its block drafters on unshifted positions: position t holds x_t, its
    aux states g_t and final state y_t (which predicts x_{t+1}), at position id t. A block
    anchored at t attends to the states of positions before t, feeds x_t in its first slot and
    takes slot j's target from y_{t+j-1}, the distribution of x_{t+j}: what serving does (the
    target has states up to the token before its latest one) and what
    eyrie.evaluate.specdec.BlockProposer decodes. So the loss at t counts iff x_t is an
    assistant token: loss_mask[t]. (EAGLE-3's shift would hand the block x_{t+1} after context
    that ends at x_{t-1}: a token missing between them.)
    Out: the keys of shift_sample, each of length T; position_ids 0..T-1.
    """
    T = sample["input_ids"].shape[0]
    return {
        "input_ids": sample["input_ids"],
        "hidden_states": sample["aux_hidden"],
        "verifier_last_hidden_states": sample["final_hidden"],
        "loss_mask": sample["loss_mask"].to(torch.bool),
        "position_ids": torch.arange(T, dtype=torch.long),
        **(
            {
                "hidden_states_scale": sample["aux_scale"],
                "verifier_last_hidden_states_scale": sample["final_scale"],
            }
            if "aux_scale" in sample
            else {}
        ),
    }


CODE_SCALES = {
    "hidden_states": "hidden_states_scale",
    "verifier_last_hidden_states": "verifier_last_hidden_states_scale",
}


def decode_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch of float8 codes (PackedShards.batch(..., torch.uint8), on any device) with its
    hidden states decoded to float32 and the scales dropped; other batches as they are."""
    if "hidden_states_scale" not in batch:
        return batch
    from eyrie.formats.codecs import decode_e4m3

    out = {k: v for k, v in batch.items() if k not in CODE_SCALES.values()}
    for name, scale in CODE_SCALES.items():
        out[name] = decode_e4m3(batch[name], batch[scale])
    return out


def pack(lengths: list[int], order: list[int], max_tokens: int, gap: int) -> list[list[int]]:
    """Greedy packing in `order`: each sample takes min(length, max_tokens - gap) + gap tokens."""
    batches, current, used = [], [], 0
    for i in order:
        need = min(lengths[i], max_tokens - gap) + gap
        if current and used + need > max_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += need
    if current:
        batches.append(current)
    return batches


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order of the samples in `epoch`: a permutation seeded by `seed` and the epoch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


class PackedShards:
    """All samples of the shards, addressed by a flat index; `batch(indices)` packs some of them.

    `values_checked=True` says every stored value was scanned before (train's verify_shards pass,
    or eyrie.formats.hidden.validate_shard): reads then skip the per-sample finite check.
    Otherwise each sample is checked as it is read (no inf/NaN is handed out unnoticed).
    `shifted`: EAGLE-3's alignment (shift_sample, T - 1 positions), else a block drafter's
    (block_sample, T positions).
    """

    def __init__(
        self,
        paths: list[Path],
        expect: dict,
        max_tokens: int,
        gap: int,
        values_checked: bool = False,
        layers: list[int] | None = None,
        shifted: bool = True,
    ):
        self.max_tokens, self.gap = max_tokens, gap
        self.align = shift_sample if shifted else block_sample
        # the aligned sample: its first position's token index (the shift drops x_0 and its mask
        # starts at x_2) and its length (T - 1 shifted, T as stored)
        first, cut = (2, 1) if shifted else (1, 0)
        # Opening every reader first: a mismatching shard fails before any training.
        self.readers = [
            ShardReader(p, expect=expect, check_values=not values_checked) for p in paths
        ]
        self.refs: list[tuple[int, int]] = []  # (reader, sample) of each usable sample
        self.lengths: list[int] = []  # aligned length (T - 1 shifted, T for a block drafter)
        self.loss_tokens: list[int] = []  # loss-masked positions once aligned and truncated
        self.skipped = 0
        for r_i, reader in enumerate(self.readers):
            mask = reader.f["loss_mask"][:]
            csum = np.concatenate([[0], np.cumsum(mask != 0)])
            for s_i, (a, b) in enumerate(zip(reader.offsets[:-1], reader.offsets[1:])):
                if b - a < first + 1 or not mask[a + first : b].any():
                    self.skipped += 1  # no token to predict under the aligned loss mask
                    continue
                self.refs.append((r_i, s_i))
                self.lengths.append(int(b - a - cut))
                # the aligned mask's first n positions: shifted, mask[2:] + [0], so
                # mask[a+2 : a+2+min(n, T-2)]; a block drafter's, mask[a : a+n] (x_0 never
                # counts: no block is anchored before it, and its mask is the prompt's)
                n = min(int(b - a - cut), max_tokens - gap)
                start = a + first if shifted else a
                stop = a + first + min(n, b - a - first) if shifted else a + n
                self.loss_tokens.append(int(csum[stop] - csum[start]))
        if not self.refs:
            raise EyrieError(
                f"{paths[0]}...: no sample has a loss-masked token to predict; "
                "check the tokenized shards' loss_mask (assistant turns)"
            )
        self.truncated = sum(n > max_tokens - gap for n in self.lengths)
        self.hidden_size = int(expect["hidden_size"])
        stored = list(expect["aux_layer_ids"])
        # `layers`: the stored layers a draft reads, in its order (train.aux_ids); the batch
        # then holds their columns of the concatenated states only
        self.columns = None if layers in (None, stored) else [stored.index(i) for i in layers]
        self.n_aux = len(stored) if self.columns is None else len(self.columns)
        # Hidden states travel in their stored dtype when widening them to float32 later is exact
        # and equal to the float32 read (bfloat16, float16); float8 shards as their codes and
        # scales, decoded on the device (decode_batch); a mix of storage dtypes as float32.
        stored = sorted({r.meta.storage_dtype for r in self.readers})
        exact = len(stored) == 1 and stored[0] in ("bfloat16", "float16", "float32")
        codes = stored == ["float8_e4m3"]
        self.transfer_dtype = (
            getattr(torch, stored[0]) if exact else (torch.uint8 if codes else torch.float32)
        )

    def __len__(self) -> int:
        return len(self.refs)

    def tokens(self, indices: list[int]) -> tuple[int, int]:
        """(positions that belong to a sample, loss-masked positions) of the pack `indices`:
        what (document_ids >= 0).sum() and loss_mask.sum() of `batch(indices)` count."""
        return (
            sum(min(self.lengths[i], self.max_tokens - self.gap) for i in indices),
            sum(self.loss_tokens[i] for i in indices),
        )

    def batch(
        self,
        indices: list[int],
        dtype: torch.dtype = torch.float32,
        pin: bool = False,
        pad_to: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Packed batch, each value [1, L, ...]: hidden_states `dtype` [1, L, n_aux*H] (the
        columns of `layers` where given),
        verifier_last_hidden_states `dtype` [1, L, H], input_ids/position_ids/document_ids
        int64 [1, L], loss_mask bool [1, L]; each sample followed by `gap` padding positions.

        Hidden states go from the file's pages (ShardReader maps them) straight into the
        preallocated batch. `dtype` float32 is the training dtype; `transfer_dtype` keeps the
        stored values for a widening to float32 on the device (uint8 for float8 shards: their
        codes, plus hidden_states_scale / verifier_last_hidden_states_scale float32 [1, L] for
        decode_batch). `pin`: page-locked host memory (CUDA). `pad_to`: at least this many
        positions, the rest padding like the gaps: one shape for a compiled draft."""
        gap = self.gap
        sizes = [min(self.lengths[i], self.max_tokens - gap) for i in indices]
        L = sum(sizes) + gap * len(indices)
        codes = dtype == torch.uint8  # float8 shards: codes as stored + per-token scales
        if codes and self.transfer_dtype != torch.uint8:
            raise EyrieError(
                "PackedShards.batch: uint8 (float8 codes) needs every shard stored as float8_e4m3"
            )
        out = self._empty(max(L, pad_to or 0), dtype, pin, codes)
        keys = [k for k in out if k != "document_ids"]
        pos = 0
        for doc, (i, n) in enumerate(zip(indices, sizes)):
            r_i, s_i = self.refs[i]
            # as stored (views of the file's pages); float8 dequantized to float32, or as codes
            s = self.align(self.readers[r_i].read(s_i, torch.uint8 if codes else None))
            if self.columns is not None:
                aux = s["hidden_states"]
                rows = aux.view(aux.shape[0], -1, self.hidden_size)[:, self.columns]
                s["hidden_states"] = rows.reshape(aux.shape[0], -1)
            for k in keys:
                out[k][pos : pos + n].copy_(s[k][:n])
                out[k][pos + n : pos + n + gap].zero_()
            out["document_ids"][pos : pos + n].fill_(doc)
            out["document_ids"][pos + n : pos + n + gap].fill_(-1)
            pos += n + gap
        for k, v in out.items():  # the tail up to pad_to
            v[L:].fill_(-1 if k == "document_ids" else 0)
        return {k: v.unsqueeze(0) for k, v in out.items()}

    def _empty(self, L: int, dtype: torch.dtype, pin: bool, codes: bool) -> dict[str, torch.Tensor]:
        """The batch's tensors of L positions, unfilled (float8 codes: with their scales)."""
        H, n_aux = self.hidden_size, self.n_aux
        out = {
            "hidden_states": torch.empty(L, n_aux * H, dtype=dtype, pin_memory=pin),
            "verifier_last_hidden_states": torch.empty(L, H, dtype=dtype, pin_memory=pin),
            "input_ids": torch.empty(L, dtype=torch.long, pin_memory=pin),
            "loss_mask": torch.empty(L, dtype=torch.bool, pin_memory=pin),
            "position_ids": torch.empty(L, dtype=torch.long, pin_memory=pin),
            "document_ids": torch.empty(L, dtype=torch.long, pin_memory=pin),
        }
        if codes:
            for scale in CODE_SCALES.values():
                out[scale] = torch.empty(L, dtype=torch.float32, pin_memory=pin)
        return out

    def close(self) -> None:
        for r in self.readers:
            r.close()


@dataclass(frozen=True)
class Plan:
    """Every epoch's packs (lists of sample indices) in training order, and the steps they make:
    each step takes `packs_per_step` consecutive packs; a trailing remainder is dropped."""

    epochs: list[list[list[int]]]
    packs_per_step: int
    steps_per_epoch: list[int]
    total_steps: int
    dropped: int  # trailing packs too few for a step, over all epochs

    @classmethod
    def build(cls, data: PackedShards, seed: int, epochs: int, packs_per_step: int) -> "Plan":
        plan = [
            pack(data.lengths, epoch_order(len(data), seed, e), data.max_tokens, data.gap)
            for e in range(epochs)
        ]
        steps = [len(p) // packs_per_step for p in plan]
        dropped = sum(len(p) % packs_per_step for p in plan)
        return cls(plan, packs_per_step, steps, sum(steps), dropped)

    def steps_from(
        self, epoch: int, step_in_epoch: int, rank: int, k: int
    ) -> list[tuple[int, int, list[list[int]], list[list[int]]]]:
        """(epoch, step in epoch, rank's k packs, all packs) of every step from a position on;
        rank r trains the step's packs r*k .. r*k+k-1."""
        P, out = self.packs_per_step, []
        for e in range(epoch, len(self.epochs)):
            for s in range(step_in_epoch if e == epoch else 0, self.steps_per_epoch[e]):
                packs = self.epochs[e][s * P : (s + 1) * P]
                out.append((e, s, packs[rank * k : (rank + 1) * k], packs))
        return out


@dataclass(frozen=True)
class BatchSpec:
    """How the loader lays a pack out (`PackedShards.batch`'s dtype, pin and pad_to)."""

    dtype: torch.dtype = torch.float32
    pin: bool = False
    pad_to: int | None = None


class Prefetcher:
    """Builds the packs of the coming steps in a background thread, at most `depth` steps ahead.

    `steps`: for each step, in order, the packs (lists of sample indices) this process trains.
    `get()` returns the next step's batches (each `data.batch` of a pack, laid out by `spec`); an
    exception raised in the thread is raised again by `get()`, with the thread's traceback.
    `close()` (also on leaving a `with`) stops the thread and waits for it; it runs as a daemon,
    so a process that ends without close() (a signal's exit) does not wait for it.
    """

    def __init__(
        self,
        data: PackedShards,
        steps: Iterable[list[list[int]]],
        *,
        spec: BatchSpec = BatchSpec(),
        depth: int = 2,
    ):
        self._data, self._spec = data, spec
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(list(steps),), name="eyrie-prefetch", daemon=True
        )
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, steps: list[list[list[int]]]) -> None:
        try:
            for packs in steps:
                spec = self._spec
                batches = [self._data.batch(p, spec.dtype, spec.pin, spec.pad_to) for p in packs]
                if not self._put(("ok", batches)):
                    return
            self._put(("end", None))
        except BaseException as exc:  # handed to the main thread, which raises it
            self._put(("error", exc))

    def get(self) -> list[dict[str, torch.Tensor]]:
        """The next step's batches; blocks until they are built."""
        while True:
            try:
                kind, value = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch thread ended without a result") from None
        if kind == "error":
            self.close()
            raise value
        if kind == "end":
            raise StopIteration("no more steps planned")
        return value

    def close(self) -> None:
        self._stop.set()
        while True:  # a producer blocked on a full queue sees the stop flag within 0.1 s
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)  # a read under way finishes (or fails on closed files)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

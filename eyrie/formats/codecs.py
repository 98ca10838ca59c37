"""Stored representations of hidden states: the storage dtypes of a shard (`STORAGE`), the
bfloat16 and float8 e4m3 codecs, and the finite checks on stored values.

Contract: a value encodes and decodes to the same bytes on a CPU and a GPU (float8 scales are
row amax times 1/448, codes the row times the scale's reciprocal, rounded to nearest even).
docs/shard-format.md ("STORE dtypes", "float8_e4m3") defines each representation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# the two state datasets of a shard and, for float8 storage, the scale dataset of each
HIDDEN = ("aux_hidden", "final_hidden")
SCALES = {"aux_hidden": "aux_scale", "final_hidden": "final_scale"}

E4M3_MAX = 448.0  # largest finite float8 e4m3fn value
E4M3_INV = 1.0 / E4M3_MAX  # scales are amax times this: a multiply rounds alike on every device
SCALE_MIN = 2.0**-126  # smallest normal float32: the scale of an all-zero (or tiny) row

STEP_BYTES = 256 << 10  # check / dequantize this much at a time (stays in the CPU cache)
QUANTIZE_STEP_BYTES = 1 << 20  # quantize on the CPU ~1 MiB of float32 at a time


@dataclass(frozen=True)
class Storage:
    """How one storage_dtype is stored and checked."""

    h5: type  # numpy dtype of the hidden datasets
    bits: type  # unsigned view for the finite check
    abs_mask: int  # clears the sign bit
    non_finite: int  # (bits & abs_mask) >= non_finite: inf or NaN
    scaled: bool  # per-token float32 scales in aux_scale / final_scale


STORAGE = {
    "bfloat16": Storage(np.uint16, np.uint16, 0x7FFF, 0x7F80, False),
    "float16": Storage(np.float16, np.uint16, 0x7FFF, 0x7C00, False),
    "float32": Storage(np.float32, np.uint32, 0x7FFFFFFF, 0x7F800000, False),
    # e4m3fn has no inf; NaN is S.1111.111. read() dequantizes to float32 by default.
    "float8_e4m3": Storage(np.uint8, np.uint8, 0x7F, 0x7F, True),
}


STORAGE_DTYPES = {name: s.h5 for name, s in STORAGE.items()}


def bytes_per_token(storage_dtype: str, n_states: int, hidden: int) -> int:
    """Hidden-state bytes per token: n_states (aux + final) rows of `hidden` values, plus the two
    float32 scales (aux, final) of float8_e4m3. input_ids and loss_mask add 5 more."""
    s = STORAGE[storage_dtype]
    return n_states * hidden * np.dtype(s.h5).itemsize + (2 * 4 if s.scaled else 0)


def transfer_dtype(storage_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The dtype host states travel in before `stored_arrays`: the storage dtype, or for
    float8_e4m3 (quantized per token there) the compute dtype, so values round once."""
    return compute if STORAGE[storage_dtype].scaled else getattr(torch, storage_dtype)


def to_storage(x: torch.Tensor, storage_dtype: str) -> np.ndarray:
    """Tensor -> numpy array in an unscaled stored representation (bf16 as its 16-bit pattern)."""
    if storage_dtype == "bfloat16":
        return (
            x.detach()
            .to(torch.bfloat16)
            .cpu()
            .contiguous()
            .view(torch.int16)
            .numpy()
            .view(np.uint16)
        )
    return x.detach().to(getattr(torch, storage_dtype)).cpu().contiguous().numpy()


def quantize_e4m3_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, W] (any float dtype, any device) -> (codes uint8 [T, W] e4m3fn bit patterns,
    scale float32 [T]) on x's device, with x ~ e4m3(codes) * scale[:, None];
    scale = max(row amax * (1/448), 2^-126), codes = x * (1 / scale) rounded to nearest (even).
    A non-finite row gives a non-finite scale."""
    T, W = x.shape
    codes = torch.empty((T, W), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(T, dtype=torch.float32, device=x.device)
    step = T if x.is_cuda else max(1, QUANTIZE_STEP_BYTES // (4 * W))
    for a in range(0, T, step):
        xs = x[a : a + step].detach().to(torch.float32)  # [rows, W]
        s = (torch.linalg.vector_norm(xs, ord=float("inf"), dim=1) * E4M3_INV).clamp_(min=SCALE_MIN)
        # times the reciprocal, not divided: a reciprocal and a multiply round alike on a CPU and
        # a GPU (division kernels do not), so codes are the same bytes wherever they are made
        codes[a : a + step] = (xs * s.reciprocal()[:, None]).clamp_(-E4M3_MAX, E4M3_MAX)
        scale[a : a + step] = s
    return codes.view(torch.uint8), scale


def quantize_e4m3(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """quantize_e4m3_tensor as host numpy arrays (codes uint8 [T, W], scale float32 [T])."""
    codes, scale = quantize_e4m3_tensor(x)
    return codes.cpu().numpy(), scale.cpu().numpy()


def stored_arrays(
    aux: torch.Tensor, final: torch.Tensor, storage_dtype: str
) -> dict[str, np.ndarray]:
    """One sample's stored representation on the host: aux [T, n_aux*H] and final [T, H] (any
    float dtype, any device) -> {dataset name: numpy [T, ...]} (float8: codes plus scales)."""
    stored: dict[str, np.ndarray] = {}
    for name, x in zip(HIDDEN, (aux, final)):
        if STORAGE[storage_dtype].scaled:
            stored[name], stored[SCALES[name]] = quantize_e4m3(x)
        else:
            stored[name] = to_storage(x, storage_dtype)
    return stored


def non_finite_dataset(stored: dict[str, np.ndarray], storage_dtype: str) -> str | None:
    """The first of HIDDEN whose stored values (of `stored_arrays`) hold inf/NaN, else None.
    Checked after the cast: float16 storage overflows where the compute dtype did not."""
    for name in HIDDEN:
        if STORAGE[storage_dtype].scaled:
            bad = bad_scale_row(stored[SCALES[name]]) is not None  # amax finite <=> row finite
        else:
            bad = not all_finite(stored[name], storage_dtype)
        if bad:
            return name
    return None


def stored_tensors(
    aux: torch.Tensor, final: torch.Tensor, storage_dtype: str
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The stored representation of rows, computed where they are (on the GPU, before the copy
    to the host): aux [N, n_aux*H] and final [N, H] -> ({dataset name: tensor [N, ...]} in the
    on-disk dtype (bfloat16 as int16 bit patterns, float8 as uint8 codes plus float32 scales),
    bad [N] uint8: bit k set where row values of HIDDEN[k] are inf/NaN after the cast)."""
    stored: dict[str, torch.Tensor] = {}
    bad = torch.zeros(aux.shape[0], dtype=torch.uint8, device=aux.device)
    for k, (name, x) in enumerate(zip(HIDDEN, (aux, final))):
        if STORAGE[storage_dtype].scaled:
            stored[name], stored[SCALES[name]] = quantize_e4m3_tensor(x)
            s = stored[SCALES[name]]
            ok = torch.isfinite(s) & (s > 0)  # amax finite <=> row finite
        else:
            y = x.detach().to(getattr(torch, storage_dtype))
            ok = torch.isfinite(y).all(dim=1)  # after the cast, as non_finite_dataset
            stored[name] = y.view(torch.int16) if storage_dtype == "bfloat16" else y
        bad |= (~ok).to(torch.uint8) << k
    return stored, bad


E4M3_VALUES = (
    torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
)  # [256] float32: the value of each code (torch's own cast; NaN at 0x7F, 0xFF)


def decode_e4m3(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., W] (e4m3fn bit patterns), scale float32 [...] -> float32 [..., W] =
    e4m3(code) * scale on the codes' device: the same values as dequantize_e4m3 (torch's float8
    cast is exact in float32, and one float32 multiply rounds alike everywhere)."""
    return codes.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)


def dequantize_e4m3(codes: np.ndarray, scale: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """codes uint8 [T, W], scale float32 [T] -> out [T, W]: float32 `e4m3(code) * scale`
    (bit-exact to torch's float8 cast times the scale), or that rounded to nearest even once
    more for a bfloat16 `out`. A table lookup and a multiply per ~256 KiB of output, in numpy:
    one thread, where torch's CPU ops would wait on OpenMP workers that share the cores."""
    T, W = codes.shape
    if out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize_e4m3 writes float32 or bfloat16, not {out.dtype}")
    step = max(1, (STEP_BYTES // 4) // W)
    o32 = out.numpy() if out.dtype == torch.float32 else np.empty((min(step, T), W), np.float32)
    bits = None if out.dtype == torch.float32 else out.view(torch.int16).numpy().view(np.uint16)
    u = np.empty((min(step, T), W), np.uint32)
    for a in range(0, T, step):
        b = min(T, a + step)
        o = o32[a:b] if bits is None else o32[: b - a]
        np.take(E4M3_VALUES, codes[a:b], out=o)
        np.multiply(o, scale[a:b, None], out=o)
        if bits is not None:  # float32 -> bfloat16, round to nearest even: the upper 16 bits of
            v, t = o.view(np.uint32), u[: b - a]  # bits + 0x7FFF + (bit 16)
            np.right_shift(v, 16, out=t)
            np.bitwise_and(t, 1, out=t)
            t += v
            t += 0x7FFF
            np.right_shift(t, 16, out=t)
            bits[a:b] = t
    return out


def first_bad_row(a: np.ndarray, storage_dtype: str) -> int | None:
    """First row of `a` (stored values, [rows, ...]) holding inf/NaN, else None. One and + max
    per 256 KiB through a reused scratch buffer (no full-size temporaries)."""
    s = STORAGE[storage_dtype]
    if a.size == 0:
        return None
    flat = np.ascontiguousarray(a).reshape(-1).view(s.bits)
    n = max(1, STEP_BYTES // flat.itemsize)
    scratch = np.empty(min(n, flat.size), s.bits)
    for k in range(0, flat.size, n):
        part = scratch[: min(n, flat.size - k)]
        np.bitwise_and(flat[k : k + n], s.abs_mask, out=part)
        if part.max() >= s.non_finite:
            return (k + int(np.argmax(part >= s.non_finite))) // (a.size // len(a))
    return None


def all_finite(a: np.ndarray, storage_dtype: str) -> bool:
    """Whether every stored value is finite (bit patterns: exponent bits not all ones)."""
    return first_bad_row(a, storage_dtype) is None


def bad_scale_row(scale: np.ndarray) -> int | None:
    """First float8 scale that is not finite and positive, else None."""
    bad = ~(np.isfinite(scale) & (scale > 0))
    return int(np.argmax(bad)) if bad.any() else None

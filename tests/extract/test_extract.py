"""eyrie extract: stored hidden states equal a reference computed another way, and batching
gives the same stored values as one sample at a time (tiny Llama and tiny DeepseekV3)."""

from __future__ import annotations

import dataclasses
import json

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from eyrie.arch.target import inspect_target, tokenizer_hash
from eyrie.config.schema import validate_config
from eyrie.config.sections import ExtractSettings
from eyrie.core.errors import EyrieError
from eyrie.extract import hf as extract_stage_hf
from eyrie.extract.batches import plan_batches
from eyrie.extract.extractor import Extractor, backend_class, extract_shard
from eyrie.extract.hf import HFBackend
from eyrie.formats.hidden import ShardReader
from eyrie.formats.tokenized import read_tokenized
from tests.support.extract_helpers import (
    AUX,
    LENGTHS,
    build_case,
    extract_args,
    settings,
    write_tokenized,
)
from tests.support.stages import run_stage


def reference(model, ids: np.ndarray) -> dict[int, torch.Tensor]:
    """Plain HF forward of one sample: output_hidden_states[k] for aux ids, the final norm's
    input (a forward hook, not our capture code) for id N. ids: [T] -> {id: [T, H] float32}."""
    seen = {}
    h = model.model.norm.register_forward_hook(lambda mod, args, out: seen.setdefault("n", args[0]))
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True)
    h.remove()
    N = model.config.num_hidden_layers
    ref = {k: out.hidden_states[k][0] for k in AUX}
    ref[N] = seen["n"][0]
    return ref


def raw(path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {
            k: f[k][:] for k in ("input_ids", "loss_mask", "offsets", "aux_hidden", "final_hidden")
        }


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers at |x| (x: bfloat16), as float32."""
    mag = x.abs().contiguous()
    nxt = (mag.view(torch.int16) + 1).view(torch.bfloat16)
    return nxt.float() - mag.float()


# Batched and one-by-one forwards are NOT bit-identical in float32 (the reductions inside SDPA
# attention run over the padded key length, and each MoE expert's matmul over however many tokens
# of the batch it received, so summation order differs). Measured on these models: per token row,
# |batched - single| <= 7 * eps32 * max|row| for float32 values, and 0.03% of bf16 values differ
# (by one rounding step of that noise). Asserted with ~2x margin; see docs/shard-format.md.
ROW_EPS32 = 16
MAX_BF16_MISMATCH = 0.005


def assert_batching_equivalent(batched: torch.Tensor, single: torch.Tensor) -> int:
    """batched, single: [T, C] bfloat16 as stored. Returns the number of differing values."""
    rowmax = single.float().abs().amax(dim=1, keepdim=True)  # [T, 1]
    noise = ROW_EPS32 * torch.finfo(torch.float32).eps * rowmax
    diff = (batched.float() - single.float()).abs()
    bound = noise + torch.maximum(bf16_ulp(batched), bf16_ulp(single))
    assert bool((diff <= bound).all()), float((diff - bound).max())
    return int((batched != single).sum())


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_batched_equals_one_by_one_and_reference(tmp_path, kind):
    target, shard, preflight, ids, masks = build_case(tmp_path, kind)
    # the batched plan really batches (several samples per forward, with padding)
    assert max(len(b) for b in plan_batches(LENGTHS, 96)) >= 3
    batched, single = tmp_path / "batched.h5", tmp_path / "single.h5"
    rc = run_stage("extract", *extract_args(target, shard, preflight, batched, settings(96)))
    assert rc == 0
    extract_shard(target, shard, preflight, single, settings(1))  # every sample alone

    a, b = raw(batched), raw(single)
    for name in ("input_ids", "loss_mask", "offsets"):
        assert np.array_equal(a[name], b[name]), name

    N = 4
    expect = {
        "target_fingerprint": inspect_target(target).fingerprint,
        "tokenizer_hash": tokenizer_hash(target),
        "aux_layer_ids": AUX,
        "final_layer_id": N,
        "hidden_size": 32,
    }
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    mismatches = 0
    with ShardReader(batched, expect=expect) as rb, ShardReader(single, expect=expect) as rs:
        assert rb.sample_ids() == [f"conv.jsonl:{i + 1}" for i in range(len(ids))]
        assert rb.meta.producer["settings"] == settings(96)
        assert rb.meta.producer["provenance"]["versions"]["torch"]
        for i in range(len(ids)):
            got, one = rb.read(i), rs.read(i)
            assert torch.equal(got["input_ids"], torch.from_numpy(ids[i].astype(np.int64)))
            assert torch.equal(got["loss_mask"], torch.from_numpy(masks[i].astype(bool)))
            for name in ("aux_hidden", "final_hidden"):
                mismatches += assert_batching_equivalent(got[name], one[name])
            # one sample at a time is bit-identical to a plain HF forward of that sample
            ref = reference(model, ids[i])
            assert torch.equal(one["aux_hidden"], torch.cat([ref[k] for k in AUX], -1).bfloat16())
            assert torch.equal(one["final_hidden"], ref[N].bfloat16())
            # the layers really differ (a capture of the wrong layer would not pass unnoticed)
            assert not torch.equal(ref[N], ref[AUX[-1]])
    assert mismatches <= MAX_BF16_MISMATCH * (a["aux_hidden"].size + a["final_hidden"].size)


def test_float32_storage_matches_reference_exactly(tmp_path):
    target, shard, preflight, ids, _ = build_case(tmp_path, "llama")
    out = tmp_path / "f32.h5"
    extract_shard(target, shard, preflight, out, settings(1, storage="float32"))
    with ShardReader(out) as reader:
        got = reader.read(1)
        assert got["final_hidden"].dtype == torch.float32
    ref = reference(
        AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval(), ids[1]
    )
    assert torch.equal(got["final_hidden"], ref[4])
    assert torch.equal(got["aux_hidden"], torch.cat([ref[k] for k in AUX], dim=-1))


def test_float8_storage_is_within_its_bound(tmp_path):
    """extract.storage_dtype float8_e4m3: e4m3 codes + a float32 scale per token row, read back
    (dequantized to float32) within amax / 28 of the reference per token row (the derived bound,
    docs/shard-format.md; one sample at a time, so the values before rounding equal it)."""
    target, shard, preflight, ids, _ = build_case(tmp_path, "llama")
    out = tmp_path / "f8.h5"
    extract_shard(target, shard, preflight, out, settings(1, storage="float8_e4m3"))
    with h5py.File(out, "r") as f:
        assert f.attrs["storage_dtype"] == "float8_e4m3" and f["aux_hidden"].dtype == np.uint8
        assert f["aux_scale"].shape == f["final_scale"].shape == (sum(LENGTHS),)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    worst = 0.0
    with ShardReader(out) as reader:
        for i in range(len(ids)):
            got, ref = reader.read(i), reference(model, ids[i])
            for name, want in (
                ("aux_hidden", torch.cat([ref[k] for k in AUX], -1)),
                ("final_hidden", ref[4]),
            ):
                assert got[name].dtype == torch.float32
                amax = want.abs().amax(dim=1)  # [T]
                rel = (got[name] - want).abs().amax(dim=1) / amax
                assert bool((rel <= (1 + 2.0**-18) / 28).all()), (i, name, float(rel.max()))
                worst = max(worst, float(rel.max()))
    assert worst > 0.5 / 28  # really quantized (float32 storage would give 0)


def test_stale_or_failed_preflight_is_refused(tmp_path):
    target, shard, preflight, _, _ = build_case(tmp_path, "llama")
    out = tmp_path / "out.h5"
    preflight.write_text(json.dumps({"ok": True, "target": {"fingerprint": "0123456789abcdef"}}))
    with pytest.raises(EyrieError, match="preflight is stale.*rerun it"):
        extract_shard(target, shard, preflight, out, settings(64))
    preflight.write_text(
        json.dumps({"ok": False, "target": {"fingerprint": inspect_target(target).fingerprint}})
    )
    with pytest.raises(EyrieError, match="did not pass"):
        extract_shard(target, shard, preflight, out, settings(64))
    assert not out.exists()


def test_bad_settings_and_shard_are_refused(tmp_path):
    target, shard, preflight, _, _ = build_case(tmp_path, "llama")
    out = tmp_path / "out.h5"
    bad = settings(0)
    bad["extract"]["device"] = "tpu"
    with pytest.raises(EyrieError) as err:
        extract_shard(target, shard, preflight, out, bad)
    assert "extract.device: 'tpu' is not one of" in str(
        err.value
    ) and "extract.max_tokens_per_batch: 0 is less than the minimum" in str(err.value)
    bad = settings(64)
    bad["layers"]["aux_ids"] = [1, 4]
    with pytest.raises(EyrieError, match="layers.aux_ids.*out of range"):
        extract_shard(target, shard, preflight, out, bad)
    # token ids outside the vocabulary: one line naming the file and the sample
    write_tokenized(shard, [[1, 2, 100000]], [[0, 1, 1]], ["x:1"])
    with pytest.raises(EyrieError) as err:
        run_stage("extract", *extract_args(target, shard, preflight, out, settings(64)))
    assert str(shard) in str(err.value) and "sample x:1: token id 100000 outside" in str(err.value)
    assert "\n" not in str(err.value)
    assert not out.exists()


def test_one_extractor_loads_the_target_once_for_many_shards(tmp_path, monkeypatch):
    target, shard, preflight, _, _ = build_case(tmp_path, "llama")
    loads = []
    real_load = extract_stage_hf.load_causal_lm

    def counting_load(*args, **kwargs):
        loads.append(args[0])
        return real_load(*args, **kwargs)

    monkeypatch.setattr(extract_stage_hf, "load_causal_lm", counting_load)
    with Extractor(target, preflight, settings(96)) as extractor:
        assert isinstance(extractor.backend, HFBackend)
        first = extractor.extract(shard, tmp_path / "first.h5")
        second = extractor.extract(shard, tmp_path / "second.h5")
    assert len(loads) == 1
    extract_shard(target, shard, preflight, tmp_path / "alone.h5", settings(96))
    assert len(loads) == 2
    a, b, c = raw(first), raw(second), raw(tmp_path / "alone.h5")
    for name in a:
        assert np.array_equal(a[name], b[name]) and np.array_equal(a[name], c[name]), name
    # standalone: a bad shard fails before the (expensive) load
    write_tokenized(shard, [[1, 100000]], [[0, 1]], ["x:1"])
    with pytest.raises(EyrieError, match="token id 100000 outside"):
        extract_shard(target, shard, preflight, tmp_path / "bad.h5", settings(96))
    assert len(loads) == 2


def test_backend_registry_and_vllm_settings_pass_through():
    s = settings(64)
    assert ExtractSettings.from_settings(s).vllm is None and backend_class("hf") is HFBackend
    s["extract"]["backend"] = "vllm"
    with pytest.raises(EyrieError, match="extract.backend=vllm but --settings has no vllm section"):
        ExtractSettings.from_settings(s)
    # the vllm section reaches the backend as the config has it (schema defaults filled)
    s["vllm"] = {"tensor_parallel_size": 2}
    cfg = ExtractSettings.from_settings(s)
    defaults = validate_config({"target": {"name": "t"}})["vllm"]
    assert cfg.backend == "vllm"
    assert dataclasses.asdict(cfg.vllm) == {**defaults, "tensor_parallel_size": 2}
    s["vllm"]["anything"] = ["kept"]
    with pytest.raises(EyrieError, match="vllm.anything: unknown key"):
        ExtractSettings.from_settings(s)
    s["extract"]["backend"] = "tpu"
    s["vllm"] = 3
    with pytest.raises(EyrieError) as err:
        ExtractSettings.from_settings(s)
    assert "extract.backend: 'tpu' is not one of ['hf', 'vllm']" in str(err.value)
    assert "vllm: 3 is not of type 'object'" in str(err.value)


def test_plan_batches_respects_budget():
    lengths = [5, 23, 1, 17, 40, 9, 33, 12, 28, 2, 19, 300]
    batches = plan_batches(lengths, 64)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert len(b) * longest <= 64 or len(b) == 1
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
    assert [11] in batches  # longer than the budget: alone


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_batching_on_cuda_adds_no_error(tmp_path, kind):
    """The production path (CUDA, bfloat16 compute). Batched and one-by-one bf16 runs need not be
    bit-identical on a GPU (different kernels for different shapes); what must hold is that
    batching adds no error: both are equally close to a float32 one-by-one reference."""
    target, shard, preflight, _, _ = build_case(tmp_path, kind)
    runs = {"ref": (1, "float32"), "single": (1, "bfloat16"), "batched": (96, "bfloat16")}
    err = {}
    for name, (max_tokens, dtype) in runs.items():
        s = settings(max_tokens, storage="float32")  # no storage rounding in this comparison
        s["extract"].update(device="cuda", dtype=dtype)
        extract_shard(target, shard, preflight, tmp_path / f"{name}.h5", s)
        data = raw(tmp_path / f"{name}.h5")
        err[name] = {k: torch.from_numpy(data[k]) for k in ("aux_hidden", "final_hidden")}
    for k in ("aux_hidden", "final_hidden"):
        ref = err["ref"][k]
        e_single = float((err["single"][k] - ref).abs().mean())
        e_batched = float((err["batched"][k] - ref).abs().mean())
        same = torch.equal(err["single"][k], err["batched"][k])
        print(
            f"{kind} {k}: mean |bf16 - fp32| single {e_single:.3g}, batched {e_batched:.3g}, "
            f"bit-identical: {same}"
        )
        assert e_batched <= 1.25 * e_single + 1e-6 * float(ref.abs().mean())


@pytest.mark.parametrize(
    "ids,mask,message",
    [
        ([[1, 2], []], [[0, 1], []], "sample b:2: no tokens"),
        ([[1, 2], [3]], [[0, 1], [1, 1]], "sample b:2: 1 input_ids but 2 loss_mask values"),
        ([[1, 2], [3]], [[0, 1], [2]], "loss_mask holds values other than 0/1"),
    ],
)
def test_bad_tokenized_rows_are_named(tmp_path, ids, mask, message):
    path = tmp_path / "t.parquet"
    pq.write_table(
        pa.table({"sample_id": ["b:1", "b:2"], "input_ids": ids, "loss_mask": mask}), path
    )
    with pytest.raises(EyrieError, match=f"{path}: {message}"):
        read_tokenized(path, vocab_size=10)


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3"])
def test_gpu_staging_writes_what_the_host_path_writes(tmp_path, storage):
    """The GPU path (stored representation computed on the device, non-blocking copies into
    pinned buffers, writes at file offsets from the writer thread) stores exactly the bytes that
    ShardWriter.put stores from the same values on the host; a non-finite row is named."""
    from eyrie.extract.batches import PinnedStaging, Writers
    from eyrie.formats.codecs import stored_tensors
    from eyrie.formats.hidden import ShardMeta
    from eyrie.formats.hidden_writer import ShardWriter

    H, n_aux, lengths = 64, 3, [7, 3, 12]
    ids = [list(range(n)) for n in lengths]
    meta = ShardMeta("fp", "tok", [1, 2, 3], 4, H, storage_dtype=storage)
    torch.manual_seed(0)
    aux = [torch.randn(n, n_aux * H, dtype=torch.bfloat16) * 3 for n in lengths]
    final = [torch.randn(n, H, dtype=torch.bfloat16) for n in lengths]
    with ShardWriter(tmp_path / "host.h5", meta, ["a", "b", "c"], ids, ids) as w:
        for i in range(3):
            w.put(i, aux[i], final[i])
    staging = PinnedStaging(slots=2)
    gpu = tmp_path / "gpu.h5"
    with ShardWriter(gpu, meta, ["a", "b", "c"], ids, ids) as w, Writers(w) as writers:
        for batch in ([2, 0], [1]):  # length-sorted batches, as the backend yields them
            stored, bad = stored_tensors(
                torch.cat([aux[i] for i in batch]).cuda(),
                torch.cat([final[i] for i in batch]).cuda(),
                storage,
            )
            writers.submit(staging.stage(batch, [lengths[i] for i in batch], stored, bad))
        writers.join()
    names = ["aux_hidden", "final_hidden"] + (
        ["aux_scale", "final_scale"] if "float8" in storage else []
    )
    for k in names:
        with h5py.File(tmp_path / "host.h5") as fh, h5py.File(gpu) as fg:
            assert np.array_equal(fh[k][:], fg[k][:]), k
    ShardReader(gpu).read(2)  # and it reads back, values checked

    aux[0][5, 7] = float("nan")
    stored, bad = stored_tensors(aux[0].cuda(), final[0].cuda(), storage)
    bad_path = tmp_path / "bad.h5"
    with (
        pytest.raises(EyrieError, match="sample 0: non-finite aux_hidden"),
        ShardWriter(bad_path, meta, ["a", "b", "c"], ids, ids) as w,
        Writers(w) as writers,
    ):
        writers.submit(staging.stage([0], [7], stored, bad))
        writers.join()


@pytest.mark.parametrize("storage", ["bfloat16", "float16", "float32", "float8_e4m3"])
def test_one_write_path_stores_the_same_bytes_for_host_and_staged_batches(tmp_path, storage):
    """Every backend's batch takes one write path: a HostBatch (converted by the writer thread)
    and a StagedBatch (converted where the states are, here on the CPU, as on a GPU) store the
    bytes ShardWriter.put stores; a non-finite value is named with its sample and dataset, the
    same way on both."""
    from eyrie.extract.batches import HostBatch, StagedBatch, Writers
    from eyrie.formats.codecs import stored_tensors, transfer_dtype
    from eyrie.formats.hidden import ShardMeta
    from eyrie.formats.hidden_writer import ShardWriter

    H, n_aux, lengths = 16, 3, [7, 3, 12]
    ids = [list(range(n)) for n in lengths]
    meta = ShardMeta("fp", "tok", [1, 2, 3], 4, H, storage_dtype=storage)
    torch.manual_seed(0)
    dtype = transfer_dtype(storage, torch.float32)
    aux = [(torch.randn(n, n_aux * H) * 3).to(dtype) for n in lengths]
    final = [torch.randn(n, H).to(dtype) for n in lengths]

    class Done:  # a copy that has landed already
        def synchronize(self):
            pass

    def staged(batch: list[int], aux, final) -> StagedBatch:
        stored, bad = stored_tensors(torch.cat(aux), torch.cat(final), storage)
        host = {
            k: v.view(torch.uint16).numpy() if v.dtype == torch.int16 else v.numpy()
            for k, v in stored.items()
        }
        bounds = np.cumsum([0] + [len(a) for a in aux])
        rows = [{k: v[a:b] for k, v in host.items()} for a, b in zip(bounds[:-1], bounds[1:])]
        return StagedBatch(
            batch, [len(a) for a in aux], rows, bad.numpy(), Done(), free=lambda: None
        )

    def write(path, make) -> None:
        with ShardWriter(path, meta, ["a", "b", "c"], ids, ids) as w, Writers(w) as ws:
            for batch in ([2, 0], [1]):
                ws.submit(make(batch, [aux[i] for i in batch], [final[i] for i in batch]))
            ws.join()

    with ShardWriter(tmp_path / "put.h5", meta, ["a", "b", "c"], ids, ids) as w:
        for i in range(3):
            w.put(i, aux[i], final[i])
    write(tmp_path / "host.h5", HostBatch)
    write(tmp_path / "staged.h5", staged)
    want = (tmp_path / "put.h5").read_bytes()
    assert (tmp_path / "host.h5").read_bytes() == want
    assert (tmp_path / "staged.h5").read_bytes() == want

    final[0][5, 7] = float("nan")
    for make in (HostBatch, staged):
        path = tmp_path / "bad.h5"
        with pytest.raises(EyrieError, match=f"{path}: sample 0: non-finite final_hidden values"):
            write(path, make)
        assert not path.exists()

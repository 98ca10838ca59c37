"""Smoke tests of the benchmarks (read_path.py, page_cache_fill.py, extraction_gpu.py --tiny,
training_gpu.py --tiny, long_record.py): small data, on the CPU, each script in a subprocess.

Each checks that its script runs end to end and writes JSON with every cell and positive ratios;
the figures themselves are in BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.stages import options


def bench(script: str, args: str, **paths) -> list[str]:
    """`python benchmarks/SCRIPT ARGS --name PATH ...` (ARGS as typed, split at spaces)."""
    return [sys.executable, str(REPO / "benchmarks" / script), *args.split(), *options(**paths)]


@pytest.mark.slow
def test_read_path_smoke(tmp_path):
    out = tmp_path / "read_path.json"
    args = "--gb 0.004 --hidden 64 --min-tokens 16 --max-tokens 64 --shards 2 --repeats 1 --no-cold"
    cmd = bench("read_path.py", args, dir=tmp_path / "data", out=out)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "eyrie/peer" in run.stdout
    r = json.loads(out.read_text())
    assert set(r["cells"]) == {"warm"}
    cell = r["cells"]["warm"]
    for k in (
        "eyrie",
        "eyrie_checked",
        "eyrie_h5py",
        "eyrie_fp8",
        "eyrie_fp8_codes",
        "peer",
        "verify",
    ):
        assert cell[k]["GB_per_s"] > 0 and cell[k]["samples_per_s"] > 0, k
        if k != "peer":
            assert (
                cell[f"ratio_{k}_over_peer"] > 0 and len(cell[f"ratio_{k}_over_peer_per_pass"]) == 1
            )
    assert r["per_read_best_warm"]["ratio_eyrie_over_peer"] > 0
    assert r["data"]["shards"] == 2 and r["data"]["samples"] >= 2
    assert r["data"]["hidden_bytes"] == r["data"]["tokens"] * 4 * 64 * 2
    assert not (tmp_path / "data").exists()  # removed without --keep


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="eyrie maps samples only on Linux")
def test_page_cache_fill_smoke(tmp_path):
    out = tmp_path / "page_cache_fill.json"
    args = "--file-mb 8 --sample-mb 1 --samples 3 --rounds 1 --repeats 2 --dontneed"
    cmd = bench("page_cache_fill.py", args, dir=tmp_path, out=out)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["cold_cache_method"] == "posix_fadvise_dontneed"
    assert set(r["ways"]) == {"fault", "willneed", "populate", "pread", "sequential"}
    assert all(w["cold_gb_s"] > 0 and w["warm_ms"] > 0 for w in r["ways"].values())
    assert list(tmp_path.iterdir()) == [out]  # the data file is removed


@pytest.mark.slow
def test_extraction_benchmark_tiny(tmp_path):
    """benchmarks/extraction_gpu.py --tiny on CPU: the bare forward, eyrie's Extractor into a
    real shard, the naive peer and the raw-write limit, both model shapes, JSON with every cell."""
    out = tmp_path / "extraction.json"
    cmd = bench("extraction_gpu.py", "--tiny --tokens 1500", work=tmp_path / "work", out=out)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == ["llama8b", "deepseek"]
    for r in rows:
        assert r["tokens"] >= 1500 and r["shard_bytes"] > r["tokens"] * 4 * r["hidden"] * 2
        for k in (
            "bare_tok_s",
            "eyrie_tok_s",
            "naive_tok_s",
            "raw_write_tok_s",
            "eyrie_vs_bare",
            "eyrie_vs_naive",
        ):
            assert r[k] > 0, k
        assert len(r["bare_passes_tok_s"]) == len(r["eyrie_passes_tok_s"]) == 2


@pytest.mark.slow
def test_capture_writes_benchmark_tiny(tmp_path):
    """benchmarks/capture_writes.py on a few prompts: request files in /dev/shm into a real
    shard both ways, a table with the disk row, every scratch and shard file removed."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine (the capture path's scratch folder)")
    args = "--gib 0.01 --repeats 1 --shape llama8b"
    cmd = bench("capture_writes.py", args, work=tmp_path / "work")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [ln.split("|")[1].strip() for ln in run.stdout.splitlines() if ln.startswith("| ")]
    ways = ["fsync at close only", "write-back, no wait", "write-back, wait past 256 MiB (now)"]
    assert rows == [
        "row",
        "disk (raw pwrite)",
        "disk (raw pwrite), write-back",
        *(f"{kind}, {way}" for kind in ("mapped", "sendfile") for way in ways),
    ], run.stdout
    assert list((tmp_path / "work").iterdir()) == []


@pytest.mark.slow
def test_training_benchmark_tiny(tmp_path):
    """benchmarks/training_gpu.py --tiny on CPU: the data in both formats (speculators' own
    ArrowDataset reads the converted set back), a real `eyrie train` run, the steady-state table."""
    out = tmp_path / "training.json"
    args = "--tiny --warmup 2 --steps 6 --packs-per-step 2 --shards 2"
    cmd = bench("training_gpu.py", args, work=tmp_path / "work", out=out)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "eyrie (1 process)" in run.stdout and "data wait" in run.stdout
    r = json.loads(out.read_text())
    e = r["runs"]["eyrie"]
    assert e["measured_steps"] >= 6 and e["tokens_per_s"] > 0 and 0 <= e["data_wait_fraction"] < 1
    assert 0 < e["tokens_per_step"] <= r["tokens_per_step_budget"] == 256
    assert (
        r["conversion_check"]["samples"] == r["samples"]
        and r["conversion_check"]["checked_samples"] > 0
    )
    assert r["conversion_check"]["collated_tokens"] > 0
    if "speculators" in r["runs"]:  # a CUDA machine
        s = r["runs"]["speculators"]
        assert s["tokens_per_s"] > 0 and r["ratios"]["tokens_per_s"] > 0
    else:  # its config, vocabulary map, draft, loader and loss on the converted data, on the CPU
        assert r["speculators"].startswith("not run: speculators.train needs an accelerator")
        c = r["speculators_cpu_check"]
        assert c["train_batches"] >= 2 + 6 + 1 and c["draft_vocab"] == 128 and c["batch_tokens"] > 0
        assert c["loss"] > 0 and c["loss"] == c["loss"]  # finite, not NaN
    assert (
        r["speculators_settings"]["total_seq_len"] == 256
        and r["speculators_settings"]["max_steps"] == 9
    )
    assert not (tmp_path / "work").exists()  # removed without --keep


def test_speculators_launcher_times_each_batch():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import torch
    from speculators_launch import TimedLoader
    from torch.utils.data import DataLoader

    docs = [torch.tensor([[0, 0, -1]]), torch.tensor([[0, 1, 1]])]
    loader = DataLoader([{"document_ids": d} for d in docs], batch_size=None)
    log: list[dict] = []
    timed = TimedLoader(loader, log)
    assert len(timed) == 2 and timed.dataset is loader.dataset
    assert [b["document_ids"].tolist() for b in timed] == [d.tolist() for d in docs]
    assert [r["tokens"] for r in log] == [2, 3]
    assert all(r["got"] >= r["request"] for r in log)


@pytest.mark.slow
def test_train_step_benchmark_tiny(tmp_path):
    """benchmarks/train_step_gpu.py --tiny on CPU: a variant builds the draft, trains its timed
    steps on packed batches and prints its line; flex is refused on the CPU (no backward there)."""
    cmd = bench("train_step_gpu.py", "--tiny time")
    env = dict(os.environ, EYRIE_BENCH_WORK=str(tmp_path))
    run = subprocess.run(
        [*cmd, "attn=sdpa,T=256"], capture_output=True, text=True, timeout=180, env=env
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    line = json.loads(run.stdout.strip().splitlines()[-1])
    assert line["variant"] == "attn=sdpa,T=256" and line["tok_s"] > 0 and line["s_per_step"] > 0
    refused = subprocess.run(
        [*cmd, "attn=flex,T=256"], capture_output=True, text=True, timeout=60, env=env
    )
    assert refused.returncode != 0 and "attn=sdpa only" in refused.stderr


H200_BYTES = 143_771 * 2**20  # nvidia-smi's memory.total of the lent H200


def vllm_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "extraction_vllm", REPO / "benchmarks" / "extraction_vllm.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("shape", ["llama8b", "kimi4", "kimideepint4"])
def test_vllm_extraction_benchmark_inputs_are_what_the_extractor_reads(tmp_path, shape):
    """benchmarks/extraction_vllm.py runs only on a GPU; what it hands eyrie's Extractor (the
    target folder, the preflight report, the shard, the settings of a rehearsal) is checked here
    by the readers the Extractor uses."""
    from eyrie.arch.target import inspect_target
    from eyrie.core.rehearsal import is_rehearsal
    from eyrie.extract.extractor import ExtractSettings
    from eyrie.formats.report import read_report
    from eyrie.formats.tokenized import read_tokenized

    bench = vllm_bench()
    made = bench.write_target(tmp_path, shape, 8, gpu_bytes=H200_BYTES)
    info = inspect_target(tmp_path / shape)
    assert info.num_hidden_layers == made["layers"]
    read_report(tmp_path / f"{shape}-preflight.json", info.fingerprint)
    _, ids, masks = read_tokenized(tmp_path / f"{shape}.parquet", info.vocab_size)
    assert len(ids) == 8 and all(1024 <= len(x) <= 2048 for x in ids)
    assert made["tokens"] == sum(len(x) for x in ids)
    for path in ("native", "capture"):
        settings = bench.settings(path, made["aux"], "float8_e4m3")
        assert is_rehearsal(settings)
        assert ExtractSettings.from_settings(settings).storage_dtype == "float8_e4m3"


def test_vllm_extraction_table_ratios(capsys):
    """The table's two ratios: the back-to-back shards' tokens/s over min(bare, the faster
    page-cache rate) and over min(bare, the faster rate until fsync returns)."""
    bench = vllm_bench()
    one = {"shards": 1, "seconds": 2.5, "engine_s": 0.1, "read_s": 0.2, "writers_s": 0.3}
    many = {**one, "shards": 3, "seconds": 6.0, "close_s": 0.05}
    results = {
        "shards": 3,
        "shapes": {
            "llama8b": {
                "tokens": 1000,
                "bare": {"seconds": 1.0},
                "disk": {"7": 0.8},
                "disk_writeback": {"7": 0.5},
                "disk_fsync": {"7": 3.0},
                "disk_writeback_fsync": {"7": 2.0},
                "capture": {
                    "storage": {
                        "bfloat16": {
                            "delivered_s": 1.25,
                            "end_to_end_s": 2.5,
                            "shard_bytes": 7,
                            "one": one,
                            "shards": many,
                        }
                    }
                },
            }
        },
    }
    bench.table(results)
    row = [ln for ln in capsys.readouterr().out.splitlines() if "| capture |" in ln][0]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    # bare 1,000; disk 2,000 (write-back); durable 500; 3 shards of 1,000 tokens in 6 s
    assert cells[2:5] == ["1,000", "2,000", "500"]
    assert cells[6:11] == ["800", "400", "500", "0.50", "1.00"]
    assert cells[11:] == ["0.1", "0.2", "0.3", "0.05"]


def test_deepest_kimi_fits_the_gpu_it_is_made_for():
    """The deep Kimi row's layer count: its weights by the benchmark's arithmetic fill
    gpu_memory_utilization less the headroom, and one more MoE layer would not fit. The same
    arithmetic gives the 61-layer Kimi-K2.5 text model ~595 GB, the size class of the int4
    checkpoints Moonshot publishes (~600 GB with the vision tower)."""
    bench = vllm_bench()
    text = bench.deepest_kimi(H200_BYTES)["text_config"]
    assert text["n_routed_experts"] == 384 and text["quantization_config"]["format"]
    moe, H = bench.moe_layer_bytes(text), text["hidden_size"]
    fixed = 2 * text["vocab_size"] * H * 2 + bench.mla_bytes(text) + 3 * H * 18432 * 2
    room = 0.85 * H200_BYTES - bench.KIMI_DEEP_HEADROOM
    layers = text["num_hidden_layers"]
    assert fixed + (layers - 1) * moe <= room < fixed + layers * moe
    assert layers == 11  # 1 dense + 10 MoE on an H200
    assert 550e9 < fixed + 60 * moe < 650e9
    with pytest.raises(SystemExit, match="holds"):
        bench.deepest_kimi(40 * 2**30)


@pytest.mark.slow
def test_shard_overlap_benchmark_tiny(tmp_path):
    """benchmarks/shard_overlap.py on a few prompts: shards back to back through the real
    Extractor and serving.Behind after a paced stand-in engine, every row in the table, the
    scratch and the shards removed."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine (the capture path's scratch folder)")
    args = "--gib 0.01 --shards 2 --repeats 1 --engine-tokens-per-s 400000"
    run = subprocess.run(
        bench("shard_overlap.py", args, work=tmp_path / "work"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {
        ln.split("|")[1].strip(): ln.split("|")[2:-1]
        for ln in run.stdout.splitlines()
        if ln.startswith("| ")
    }
    assert list(rows)[1:] == [
        "engine alone (a)",
        "disk, write-back, fsync per shard (d)",
        "one at a time (before)",
        "close behind (now)",
    ], run.stdout
    for name in ("one at a time (before)", "close behind (now)"):
        seconds, tokens, _, ratio, compute, writers, close, _ = (c.strip() for c in rows[name])
        assert float(seconds) > 0 and float(ratio) > 0 and float(close) >= 0
    assert list((tmp_path / "work").iterdir()) == []


@pytest.mark.slow
def test_long_record_benchmark_small():
    """benchmarks/long_record.py on a 0.05 MB record: both ways run and keep the same tokens."""
    cmd = bench("long_record.py", "--mb 0.05 --max-seq-len 32")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "first 32 tokens and mask equal: True" in proc.stdout
    assert "| head (now) | 33 |" in proc.stdout


def test_the_vllm_extraction_benchmark_checks_the_disk_before_its_shards(tmp_path):
    """A full disk mid-shard failed a row on the H100 (ENOSPC, a cut shard left behind): the
    back-to-back run first checks there is room for all its shards, naming need, free and fixes."""
    import shutil

    bench = vllm_bench()
    free = shutil.disk_usage(tmp_path).free
    bench.check_disk(tmp_path, shard_bytes=2**20, shards=3)  # 3 MiB: room
    with pytest.raises(
        RuntimeError,
        match=r"3 shards of .* GiB need .* GiB free; give --work a "
        r"larger disk, or --shards 1, or fewer --prompts",
    ):
        bench.check_disk(tmp_path, shard_bytes=free // 2 + 1, shards=3)
    with pytest.raises(RuntimeError, match=r"free; give --work a larger disk, or fewer --prompts"):
        bench.check_disk(tmp_path, shard_bytes=free + 1, shards=1)


def test_the_workflow_benchmark_passes_on_only_the_cache_variables_it_was_started_with():
    """benchmarks/workflow_gpu.py imports torch (through quality.py), which on the GPU image sets
    TORCHINDUCTOR_CACHE_DIR in its own environment; Snakemake, started from it, must not take
    that for the user's setting (the workflow would keep training's graphs outside cache.path),
    while a variable given at the start still reaches it."""
    code = (
        "import os, sys; sys.path.insert(0, 'benchmarks'); import workflow_gpu as w; "
        "os.environ['TORCHINDUCTOR_CACHE_DIR'] = '/tmp/torchinductor_set_by_an_import'; "
        "env = w.child_environment(); "
        "print(env.get('TORCHINDUCTOR_CACHE_DIR'), env.get('TRITON_CACHE_DIR'), "
        "env.get('EYRIE_UNRELATED'), w.caches(w.Path('.'))['preset_in_environment'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(TRITON_CACHE_DIR="/users/triton", EYRIE_UNRELATED="kept")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[:3] == ["None", "/users/triton", "kept"]
    assert "torchinductor_set_by_an_import" not in " ".join(out[3:])

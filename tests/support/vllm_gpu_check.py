"""GPU check of the vLLM extraction backend against the Hugging Face one (run on a CUDA machine in
the vLLM environment; tests/vllm/test_vllm_gpu.py wraps it as a `gpu`-marked test).

For a tiny random-weight Llama, a DeepSeek-V3-style MLA+MoE target built from transformers
configs, and a Kimi-K2.5-style multimodal wrapper (`kimi_k25`, vLLM's own config class) around
the same DeepSeek-V3 weights: the Hugging Face reference (eyrie.arch.hooks hooks, bf16 on cuda;
the wrapper's is its text model's) and every vLLM path that preflight allows (native, capture) on
the same prompts; reports the minimum per-token cosine similarity per layer id and checks that
native is refused where it cannot return id N.

    python tests/support/vllm_gpu_check.py build DIR           # targets + prompts
    python tests/support/vllm_gpu_check.py hf DIR KIND         # reference states
    python tests/support/vllm_gpu_check.py vllm DIR KIND PATH  # one engine per process
    python tests/support/vllm_gpu_check.py compare DIR         # the table (JSON on stdout)

The rehearsal (vllm.rehearsal: true, docs/rehearsal.md) on real widths, without any weights on
disk: a Llama-3.1-8B-shaped Llama and a Kimi-K2.5-shaped `kimi_k25` wrapper (full width, 4 layers,
64 experts) built by vLLM with random weights (load_format dummy), one shard extracted through
eyrie's extractor and written by the real ShardWriter, marked as a rehearsal's:

    python tests/support/vllm_gpu_check.py rehearsal DIR KIND [PATH]  # KIND: of REHEARSAL_KINDS

(kimi_k25_int4: all 384 experts in int4 compressed-tensors, as Kimi-K2.5 ships them; vLLM 0.22
needs humming-kernels for it.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

KINDS = ("llama", "deepseek_v3", "kimi_k25")
REFERENCE = {"kimi_k25": "deepseek_v3"}  # whose Hugging Face states a kind is compared with
LENGTHS = [7, 64, 1, 130, 33, 250, 12, 90, 3, 48, 177, 20]


# What the DeepSeek-V3 configs here share with the real checkpoints (vLLM needs their
# scoring_func/topk_method to build the router)
DEEPSEEK = dict(
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    n_group=1,
    topk_group=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    torch_dtype="bfloat16",
)


# Llama widths, in the order of LLAMA_FIELDS
LLAMA_FIELDS = (
    "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads "
    "intermediate_size max_position_embeddings"
).split()
LLAMAS = {
    "tiny": (1024, 256, 4, 4, 2, 512, 1024),
    "llama-3.1-8b": (128256, 4096, 32, 32, 8, 14336, 8192),
}


def llama_config(name: str):
    """The bfloat16 LlamaConfig of LLAMAS[name]."""
    from transformers import LlamaConfig

    return LlamaConfig(**dict(zip(LLAMA_FIELDS, LLAMAS[name])), torch_dtype="bfloat16")


def make_config(kind: str):
    from transformers import DeepseekV3Config

    if kind == "llama":
        return llama_config("tiny")
    return DeepseekV3Config(
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
        moe_intermediate_size=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        q_lora_rank=256,
        max_position_embeddings=1024,
        **DEEPSEEK,
    )


def build(root: Path) -> None:
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1000, n).tolist() for n in LENGTHS]
    (root / "prompts.json").write_text(json.dumps(prompts))
    for kind in KINDS[:2]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make_config(kind)).to(torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.05)
            if kind == "deepseek_v3":  # routing bias present in the real checkpoints
                for name, buf in model.named_buffers():
                    if "e_score_correction_bias" in name:
                        buf.zero_()
        model.save_pretrained(root / kind)
    wrap_kimi(root / "deepseek_v3", root / "kimi_k25")


def wrap_kimi(text: Path, out: Path) -> None:
    """Kimi-K2.5's layout: the DeepSeek-V3 model as `text_config` (model_type kimi_k2) of a
    kimi_k25 wrapper, its weights under `language_model.` (the vision tower is left out:
    eyrie's engines run the language model only)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    text_config = json.loads((text / "config.json").read_text())
    text_config["model_type"] = "kimi_k2"
    config = {
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": text_config,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    weights = load_file(text / "model.safetensors")
    save_file({f"language_model.{k}": v for k, v in weights.items()}, out / "model.safetensors")


def layer_ids(kind: str) -> list[int]:
    return [1, 2, 3, 4]  # aux [1, 2, 3] + final N = 4


def hf(root: Path, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    from eyrie.arch.hooks import capture_hidden_states

    prompts = json.loads((root / "prompts.json").read_text())
    model = (
        AutoModelForCausalLM.from_pretrained(root / kind, dtype=torch.bfloat16).to("cuda").eval()
    )
    out, margins = {}, {}
    gates = {
        i: layer.mlp.gate
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias")
    }
    seen: dict[int, torch.Tensor] = {}

    def gate_hook(i):
        def hook(module, args):
            # the routing margin: k-th best expert score minus the best unselected one
            h = args[0].reshape(-1, args[0].shape[-1]).float()
            scores = (
                torch.sigmoid(h @ module.weight.float().T) + module.e_score_correction_bias.float()
            )
            top = scores.topk(model.config.num_experts_per_tok + 1, dim=-1).values
            seen[i] = (top[:, -2] - top[:, -1]).cpu()

        return hook

    handles = [g.register_forward_pre_hook(gate_hook(i)) for i, g in gates.items()]
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            seen.clear()
            with capture_hidden_states(model, layer_ids(kind)) as cap:
                model.base_model(input_ids=torch.tensor([ids], device="cuda"), use_cache=False)
            out[str(i)] = torch.stack([cap[k][0] for k in layer_ids(kind)], dim=1).float().cpu()
            if seen:  # [T, n_moe_layers]
                margins[str(i)] = torch.stack([seen[j] for j in sorted(seen)], dim=1)
    for h in handles:
        h.remove()
    torch.save(
        {"states": out, "margins": margins, "moe_layers": sorted(gates)}, root / f"{kind}.hf.pt"
    )


def extract_settings(aux_ids: list[int] | None, path: str, **vllm) -> dict:
    """The extraction stage's --settings for the vLLM backend on one GPU, bf16, eager, the
    `path` asked for; `vllm`: more keys of the vllm section."""
    return {
        "extract": {
            "backend": "vllm",
            "device": "cuda",
            "dtype": "bfloat16",
            "storage_dtype": "bfloat16",
            "max_tokens_per_batch": 600,
        },
        "layers": {"aux_ids": aux_ids},
        "trust_remote_code": False,
        "vllm": {
            "extraction_path": path,
            "tensor_parallel_size": 1,
            "enforce_eager": True,
            **vllm,
        },
    }


def through_a_shard(root: Path, name: str, backend, prompts: list) -> list:
    """Every prompt's (aux [T, n_aux*H], final [T, H]) float32, as the stage stores them: the
    backend's batches (host, staged or file rows) written by a ShardWriter, read back by a
    ShardReader. The backend is closed."""
    from eyrie.formats.hidden import ShardMeta, ShardReader
    from eyrie.formats.hidden_writer import ShardWriter

    ids = backend.layer_ids
    meta = ShardMeta("gpu-check", "gpu-check", ids[:-1], ids[-1], backend.H)
    shard = root / f"{name}.h5"
    sample_ids = [str(i) for i in range(len(prompts))]
    masks = [[1] * len(p) for p in prompts]
    try:
        with ShardWriter(shard, meta, sample_ids, [list(map(int, p)) for p in prompts], masks) as w:
            for batch in backend.states(prompts, torch.bfloat16):
                try:
                    batch.write(w)
                finally:
                    batch.release()
    finally:
        backend.close()
    reader = ShardReader(shard)
    got = []
    for i in range(len(prompts)):
        sample = reader.read(i, torch.float32)
        got.append((sample["aux_hidden"], sample["final_hidden"]))
    return got


def run_vllm(root: Path, kind: str, path: str) -> None:
    from eyrie.arch.target import inspect_target
    from eyrie.config.sections import ExtractSettings
    from eyrie.extract.vllm_backend import VllmBackend
    from eyrie.vllm.engine import EXTRACT_EXTRA, bounds

    prompts = [np.array(p, dtype=np.int32) for p in json.loads((root / "prompts.json").read_text())]
    info = inspect_target(root / kind)
    ids = layer_ids(kind)
    # the settings as the stage reads them (the typed sections), and the engine's lengths as
    # preflight would choose them for these prompts
    cfg = ExtractSettings.from_settings(
        extract_settings(ids[:-1], path, gpu_memory_utilization=0.5)
    )
    longest = max(map(len, prompts)) + EXTRACT_EXTRA
    engine = bounds(cfg.vllm, longest, chunked=False, source="the longest prompt")
    result = {"kind": kind, "path": path}
    try:
        backend = VllmBackend(root / kind, info, cfg, ids[:-1], ids[-1], engine=engine)
    except Exception as exc:  # noqa: BLE001 - a refusal is a result here
        result["refused"] = f"{type(exc).__name__}: {exc}"
        (root / f"{kind}.{path}.json").write_text(json.dumps(result))
        return
    out = {}
    for i, (aux, final) in enumerate(through_a_shard(root, f"{kind}.{path}", backend, prompts)):
        T = len(prompts[i])
        out[str(i)] = torch.cat([aux.reshape(T, len(ids) - 1, -1), final[:, None]], dim=1)
    torch.save(out, root / f"{kind}.{path}.pt")
    result["calls"] = "ok"
    (root / f"{kind}.{path}.json").write_text(json.dumps(result))


def compare(root: Path) -> dict:
    import vllm

    table = {"vllm_version": vllm.__version__}
    for kind in KINDS:
        reference = root / f"{REFERENCE.get(kind, kind)}.hf.pt"
        if not reference.exists():  # a family left out of this run
            continue
        saved = torch.load(reference)
        ref, margins, moe_layers = saved["states"], saved["margins"], saved["moe_layers"]
        for path in ("native", "capture"):
            meta = root / f"{kind}.{path}.json"
            if not meta.exists():
                continue
            info = json.loads(meta.read_text())
            if "refused" in info:
                table[f"{kind}/{path}"] = {"refused": info["refused"][:300]}
                continue
            got = torch.load(root / f"{kind}.{path}.pt")
            per_id = {}
            for j, k in enumerate(layer_ids(kind)):
                cos = torch.cat(
                    [
                        torch.nn.functional.cosine_similarity(got[i][:, j], ref[i][:, j], dim=-1)
                        for i in ref
                    ]
                )
                row = {
                    "min_cos": round(cos.min().item(), 6),
                    "mean_cos": round(cos.mean().item(), 6),
                    "tokens_below_0.999": int((cos < 0.999).sum()),
                }
                before = [m for m, layer in enumerate(moe_layers) if layer < k]
                if margins and before:
                    # routing margin of each token over the MoE layers before id k (HF, fp32 scores)
                    margin = torch.cat([margins[i][:, before].min(dim=1).values for i in ref])
                    low = cos < 0.999
                    row["median_routing_margin"] = round(margin.median().item(), 6)
                    if low.any():
                        row["routing_margin_of_tokens_below"] = [
                            round(x, 6) for x in margin[low].tolist()
                        ]
                        row["rank_of_those_margins_among_all"] = [
                            int((margin < x).sum()) for x in margin[low].tolist()
                        ]
                per_id[str(k)] = row
            table[f"{kind}/{path}"] = {
                "samples": len(got),
                "tokens": sum(v.shape[0] for v in got.values()),
                "per_id": per_id,
                "min_cos": min(v["min_cos"] for v in per_id.values()),
            }
    return table


# ----------------------------------------------------------------------------- rehearsal

REHEARSAL_KINDS = ("llama", "kimi_k25", "kimi_k25_int4")
# Kimi-K2.5's own quantization_config: compressed-tensors, int4 routed experts (group 32)
KIMI_INT4 = Path(__file__).resolve().parents[1] / "configs" / "kimi-k2.5-quantization.json"


def rehearsal_config(kind: str) -> dict:
    """config.json of a rehearsal target: real widths, no weights (vLLM makes them up)."""
    from transformers import DeepseekV3Config

    if kind == "llama":  # Llama-3.1-8B's shape
        config = llama_config("llama-3.1-8b").to_dict()
        config["architectures"] = ["LlamaForCausalLM"]
        return config
    # Kimi-K2.5's text model at full width (tests/support/vllm_helpers.py KIMI_K25), 4 layers and
    # 64 of its 384 experts in bfloat16 so that one GPU holds it, or all 384 in int4 as Kimi-K2.5
    # has
    int4 = kind == "kimi_k25_int4"
    text = DeepseekV3Config(
        vocab_size=163840,
        hidden_size=7168,
        num_hidden_layers=4,
        num_attention_heads=64,
        num_key_value_heads=64,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=384 if int4 else 64,
        num_experts_per_tok=8,
        q_lora_rank=1536,
        max_position_embeddings=4096,
        **DEEPSEEK,
    ).to_dict()
    text["model_type"] = "kimi_k2"
    if int4:
        text["quantization_config"] = json.loads(KIMI_INT4.read_text())
    return {
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": text,
        "torch_dtype": "bfloat16",
    }


def rehearsal(root: Path, kind: str, path: str = "auto") -> dict:
    """Extract one shard of `kind` (no weights on disk: a rehearsal) with eyrie's extractor and
    read it back (validate_shard: complete and finite); its mark, layer ids, the spread of its
    final states and the timings go to DIR/KIND.rehearsal.json
    (tests/preflight/test_rehearsal.py checks them)."""
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    from eyrie.arch.target import fingerprint, read_config
    from eyrie.config.sections import VllmSettings
    from eyrie.extract.extractor import Extractor
    from eyrie.formats.hidden import ShardReader, validate_shard
    from eyrie.vllm.engine import EXTRACT_EXTRA, bounds

    target = root / f"rehearsal-{kind}"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(rehearsal_config(kind), indent=1))
    (target / "tokenizer_config.json").write_text("{}")  # what the shard's tokenizer_hash reads
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1000, n).tolist() for n in LENGTHS]
    shard = root / f"{kind}.rehearsal.parquet"
    pq.write_table(
        pa.table(
            {
                "sample_id": [f"rehearsal:{i + 1}" for i in range(len(prompts))],
                "input_ids": pa.array(prompts, type=pa.list_(pa.int32())),
                "loss_mask": pa.array(
                    [[0] * (n // 2) + [1] * (n - n // 2) for n in LENGTHS],
                    type=pa.list_(pa.uint8()),
                ),
            }
        ),
        shard,
    )
    aux_ids = None if kind == "llama" else [1, 2, 3]
    settings = extract_settings(aux_ids, path, gpu_memory_utilization=0.6, rehearsal=True)
    # what the extractor reads of a preflight report (the whole report: preflight): the target's
    # fingerprint and the engine's lengths, as preflight chooses them for this shard
    vllm = VllmSettings.from_section(settings["vllm"])
    longest = max(LENGTHS) + EXTRACT_EXTRA
    engine = bounds(vllm, longest, chunked=False, source="the longest prompt")
    preflight = root / f"{kind}.preflight.json"
    report = {"ok": True, "target": {"fingerprint": fingerprint(read_config(target))}}
    preflight.write_text(json.dumps({**report, "vllm": {"engine": {"extraction": engine}}}))
    out = root / f"{kind}.rehearsal.h5"
    t0 = time.monotonic()
    with Extractor(target, preflight, settings) as extractor:
        start = time.monotonic() - t0
        chosen = extractor.backend.path
        t1 = time.monotonic()
        extractor.extract(shard, out)
        extract_s = time.monotonic() - t1
    meta = validate_shard(out)  # every value finite
    with ShardReader(out) as reader:
        final = torch.cat([reader.read(i)["final_hidden"].float() for i in range(len(reader))])
        rehearsal_attr = int(reader.f.attrs["rehearsal"]) if "rehearsal" in reader.f.attrs else None
    import vllm

    result = {
        "kind": kind,
        "vllm_version": vllm.__version__,
        "path": chosen,
        "engine_start_s": round(start, 1),  # import of vLLM's model classes, build, random init
        "extract_s": round(extract_s, 1),
        "tokens": int(sum(LENGTHS)),
        "shard": str(out),
        "layer_ids": [*meta.aux_layer_ids, meta.final_layer_id],
        "rehearsal": meta.rehearsal,
        "rehearsal_attr": rehearsal_attr,
        "final_hidden_std": float(final.std()),
    }
    (root / f"{kind}.rehearsal.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    cmd, root = sys.argv[1], Path(sys.argv[2])
    root.mkdir(parents=True, exist_ok=True)
    if cmd == "build":
        build(root)
    elif cmd == "hf":
        hf(root, sys.argv[3])
    elif cmd == "vllm":
        run_vllm(root, sys.argv[3], sys.argv[4])
    elif cmd == "compare":
        print(json.dumps(compare(root), indent=1))
    elif cmd == "rehearsal":
        print(json.dumps(rehearsal(root, sys.argv[3], *sys.argv[4:5]), indent=1))
    else:
        sys.exit(f"unknown step {cmd!r}: use build, hf, vllm, compare or rehearsal")

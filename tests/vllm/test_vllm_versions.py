"""Every fact eyrie relies on, pinned per installed vLLM version (docs/vllm.md's version x fact
table): each environment that scripts/setup-vllm.sh makes (`all` in CI) is asked for the facts of
the same target configs, and each fact must be what the table says for that version. A new vLLM
that changes one fails here, naming the version, the target and the fact.
"""

from __future__ import annotations

import shutil

import pytest

from eyrie.arch.target import inspect_target
from eyrie.preflight.vllm_checks import VllmTarget, vllm_checks
from eyrie.vllm.adapters import GPU_TESTED_VLLM, SUPPORTED_VLLM, TESTED_VLLM
from eyrie.vllm.facts import parse_version
from tests.support.vllm_helpers import (
    REAL_CONFIGS,
    VLLM_ENVS,
    real_facts,
    vllm_env,
    vllm_settings,
    write_target,
)

LLAMA_CALL = ["positions", "hidden_states", "residual"]
DEEPSEEK_CALL = [*LLAMA_CALL, "llama_4_scaling"]
GPT_OSS_CALL = ["hidden_states", "positions", "residual"]

# facts the same in every tested version: config -> fact -> value
EVERY_VERSION = {
    "llama": {"layer_params": LLAMA_CALL, "architecture_class": "LlamaForCausalLM"},
    "qwen3_moe": {"layer_params": LLAMA_CALL, "architecture_class": "Qwen3MoeForCausalLM"},
    "deepseek": {
        "layer_params": DEEPSEEK_CALL,
        "architecture_class": "DeepseekV3ForCausalLM",
        "helpers": {"llama_4_scaling": True},
    },
    "kimi": {
        "layer_params": DEEPSEEK_CALL,
        "architecture_class": "KimiK25ForConditionalGeneration",
        "helpers": {"llama_4_scaling": True},
    },
    "gpt_oss": {"layer_params": GPT_OSS_CALL, "architecture_class": "GptOssForCausalLM"},
    "unknown_arch": {"architecture_class": None, "eagle3_target": False},
    "*": {
        "embed_method": "embed_input_ids",
        "native_method": True,
        "native_connector": True,
        "worker_extension": True,
        # vLLM's own check accepts the environment eyrie's engines start in (0.34 refuses the V1
        # switch set to 0, which eyrie's engines no longer set)
        "engine_env_refused": None,
    },
}
EAGLE3_TARGETS = ("llama", "qwen3_moe", "deepseek", "kimi", "gpt_oss")
BASE_DRAFT_FIELDS = [
    "draft_vocab_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_fc",
    "norm_before_residual",
    "target_hidden_size",
]

# what each block drafter's speculators converter reads from the draft's config.json (read in
# vllm/transformers_utils/configs/speculators/algos.py of each version)
DFLASH_READS = [
    "aux_hidden_state_layer_ids",
    "draft_vocab_size",
    "mask_token_id",
    "target_hidden_size",
]
DSPARK_READS = [
    *DFLASH_READS,
    "block_size",
    "confidence_head_with_markov",
    "enable_confidence_head",
    "markov_head_type",
    "markov_rank",
]

# facts that differ between versions: version -> config ("*": all) -> fact -> value
BY_VERSION = {
    "0.22.0": {
        "*": {
            "default_runner": "v1",
            "native_chunked_prefill": False,
            "eagle3_draft_fields": BASE_DRAFT_FIELDS,
            # one EAGLE-3 class, whatever the draft's layer type; DFlash but no DSpark
            "eagle3_draft_classes": dict.fromkeys(["llama", "qwen3"], "Eagle3LlamaForCausalLM"),
            "block_drafts": {
                "dflash": {"class": "DFlashDraftModel", "reads": DFLASH_READS},
                "dspark": {"class": None, "reads": None},
            },
        },
        # DeepSeek-family: states captured BEFORE each layer, id N never returned
        "deepseek": {"native_ids": "1..N-1"},
        "kimi": {"native_ids": "1..N-1"},
    },
    "0.26.0": {
        "*": {
            "default_runner": "v2",
            "native_chunked_prefill": True,
            "eagle3_draft_fields": sorted([*BASE_DRAFT_FIELDS, "fc_norm", "norm_output"]),
            "eagle3_draft_classes": {
                "llama": "Eagle3LlamaForCausalLM",
                "qwen3": "Eagle3Qwen3ForCausalLM",
            },
            # DSpark served; neither converter reads sample_from_anchor yet
            "block_drafts": {
                "dflash": {
                    "class": "DFlashDraftModel",
                    "reads": sorted([*DFLASH_READS, "sliding_window_non_causal"]),
                },
                "dspark": {"class": "Qwen3DSparkModel", "reads": sorted(DSPARK_READS)},
            },
        },
        # the final-layer fix: the end layer's output is appended after the loop
        "deepseek": {"native_ids": "1..N"},
        "kimi": {"native_ids": "1..N"},
    },
}
# 0.33: the block converters read sample_from_anchor (0.26's DSpark always serves the anchor
# as a bonus token), DSpark's also its architectures and use_aux_hidden_state
BY_VERSION["0.33.0"] = {
    **BY_VERSION["0.26.0"],
    "*": {
        **BY_VERSION["0.26.0"]["*"],
        "block_drafts": {
            "dflash": {
                "class": "DFlashDraftModel",
                "reads": sorted([*DFLASH_READS, "sample_from_anchor", "sliding_window_non_causal"]),
            },
            "dspark": {
                "class": "Qwen3DSparkModel",
                "reads": sorted(
                    [*DSPARK_READS, "architectures", "sample_from_anchor", "use_aux_hidden_state"]
                ),
            },
        },
    },
}
# 0.34: the V1 runner deleted (default_runner v2 from its modules, not from use_v2_model_runner)
BY_VERSION["0.34.0"] = BY_VERSION["0.33.0"]
DENSE_IDS = {"llama": "0..N", "qwen3_moe": "0..N", "gpt_oss": "0..N"}

# the path preflight (vllm.extraction_path: auto) picks per version and config
PATHS = {
    "0.22.0": {
        "llama": "native",
        "qwen3_moe": "native",
        "gpt_oss": "native",
        "deepseek": "capture",
        "kimi": "capture",
    },
    "0.26.0": dict.fromkeys(["llama", "qwen3_moe", "gpt_oss", "deepseek", "kimi"], "native"),
    "0.33.0": dict.fromkeys(["llama", "qwen3_moe", "gpt_oss", "deepseek", "kimi"], "native"),
    "0.34.0": dict.fromkeys(["llama", "qwen3_moe", "gpt_oss", "deepseek", "kimi"], "native"),
}


def expected(version: str, config: str) -> dict:
    """The table's facts for one version and config."""
    out = dict(EVERY_VERSION["*"])
    out |= EVERY_VERSION.get(config, {})
    if config in EAGLE3_TARGETS:
        out |= {"eagle3_target": True, "eagle3_default_layers": EAGLE3_DEFAULT}
    out |= {"native_ids": DENSE_IDS.get(config)} if config in DENSE_IDS else {}
    out |= BY_VERSION[version]["*"] | BY_VERSION[version].get(config, {})
    return out


EAGLE3_DEFAULT = "get_eagle3_default_aux_hidden_state_layers"


def test_table_covers_the_tested_versions():
    # every tested version has an environment recipe and a row here, and lies inside the range
    assert set(TESTED_VLLM) == set(BY_VERSION) == set(PATHS) == set(VLLM_ENVS)
    assert set(GPU_TESTED_VLLM) <= set(TESTED_VLLM)
    low, high = SUPPORTED_VLLM
    assert all(low <= parse_version(v) < high for v in TESTED_VLLM)


@pytest.fixture(scope="module", params=sorted(VLLM_ENVS, key=parse_version))
def version_facts(request):
    """(version, facts per REAL_CONFIGS name) of one installed environment."""
    python = vllm_env(request.param)
    facts = real_facts(python)
    assert {f.version for f in facts.values()} == {request.param}
    return request.param, facts


@pytest.mark.slow
def test_facts_per_version(version_facts):
    version, facts = version_facts
    wrong = [
        f"{version} {config}.{key}: {getattr(facts[config], key)!r} (table: {value!r})"
        for config in REAL_CONFIGS
        for key, value in expected(version, config).items()
        if getattr(facts[config], key) != value
    ]
    assert wrong == []
    # how each id range was established: by running the forward, never by reading text
    for config in EAGLE3_TARGETS:
        assert facts[config].native_ids_how.startswith("forward run on a 4-layer stub stack")


@pytest.mark.slow
def test_preflight_path_per_version(version_facts, tmp_path):
    version, facts = version_facts
    chosen = {}
    for config in PATHS[version]:
        # Kimi-K2.5 as published: 595 GiB of weights, on 8 H200s
        kimi = config == "kimi"
        target = write_target(tmp_path / config, REAL_CONFIGS[config], 595 if kimi else None)
        info = inspect_target(target)
        n = info.num_hidden_layers
        aux = [1, n // 2, n - 1]
        gpus = {"tensor_parallel_size": 8, "gpu_memory_gib": 141} if kimi else {}
        got = vllm_checks(
            VllmTarget(target, info, aux, n), vllm_settings(**gpus), facts=facts[config]
        )
        assert got["problems"] == [], (version, config, got["problems"])
        chosen[config] = got["report"]["extraction_path"]["chosen"]
    assert chosen == PATHS[version]


@pytest.mark.skipif(shutil.which("hardlink") is None, reason="no hardlink command (util-linux)")
def test_environments_with_one_torch_share_its_files():
    """setup-vllm.sh hard-links what its environments share (three copies did not fit a CI
    disk): two environments with the same torch hold its libraries once."""
    torch_of = {}
    for version in VLLM_ENVS:
        site = next((vllm_env(version).parent.parent / "lib").glob("python3*/site-packages"))
        (dist,) = site.glob("torch-*.dist-info")
        torch_of.setdefault(dist.name, []).append(site)
    pairs = [sites for sites in torch_of.values() if len(sites) > 1]
    assert pairs, f"no two vLLM environments with one torch: {sorted(torch_of)}"
    for sites in pairs:
        inodes = {(site / "torch" / "lib" / "libtorch_cuda.so").stat().st_ino for site in sites}
        assert len(inodes) == 1, [str(site) for site in sites]


@pytest.fixture(scope="module")
def block_configs(world, tmp_path_factory):
    """config.json of a DFlash and of a DSpark draft as eyrie builds them (speculators' own
    classes and defaults: DSpark samples from its anchor, DFlash does not; eyrie sets
    sliding_window_non_causal, as its layers are all full attention)."""
    import json

    from tests.support.train_helpers import block_draft

    out = {}
    for method in ("dflash", "dspark"):
        folder = tmp_path_factory.mktemp(method)
        block_draft(world, method).save_pretrained(folder)
        out[method] = json.loads((folder / "config.json").read_text())
    return out


# per version: the problem each saved block draft meets (None: served as trained)
BLOCK_SERVED = {
    "0.22.0": {"dflash": None, "dspark": "serves no dspark draft"},
    "0.26.0": {"dflash": None, "dspark": "does not read it and serves the anchor as a bonus"},
    "0.33.0": {"dflash": None, "dspark": None},
    "0.34.0": {"dflash": None, "dspark": None},
}


@pytest.mark.slow
def test_which_block_drafts_each_version_serves_as_trained(version_facts, block_configs):
    """eyrie.vllm.checks.block_draft_problems on each installed vLLM's facts and speculators'
    own saved configs: 0.22 has no DSpark, 0.26 serves a DSpark draft that samples from its
    anchor with the anchor as a bonus token (its converter never reads sample_from_anchor)."""
    from eyrie.vllm.checks import block_draft_problems

    version, facts = version_facts
    assert block_configs["dspark"]["sample_from_anchor"] is True
    assert not block_configs["dflash"]["sample_from_anchor"]
    for method, config in block_configs.items():
        got = block_draft_problems(method, facts["llama"], config, "draft/config.json")
        want = BLOCK_SERVED[version][method]
        assert (got == []) if want is None else (len(got) == 1 and want in got[0]), got
        assert all(line.startswith("draft/config.json: ") for line in got)


@pytest.mark.slow
def test_a_dflash_draft_vllm_would_run_causal_is_refused(version_facts, block_configs):
    """speculators' own DFlash default, sliding_window_non_causal false, trains its full
    attention layers bidirectional within the block; vLLM 0.26 and later read the flag as
    `causal` for every layer, so that draft would be served as another network (0.22 always
    runs the block bidirectional and does not read it)."""
    from eyrie.vllm.checks import block_draft_problems

    version, facts = version_facts
    assert block_configs["dflash"]["sliding_window_non_causal"] is True  # eyrie's export
    config = {**block_configs["dflash"], "sliding_window_non_causal": False}
    got = block_draft_problems("dflash", facts["llama"], config, "draft/config.json")
    if version == "0.22.0":
        assert got == []
    else:
        assert len(got) == 1 and "reads it as `causal` for every draft layer" in got[0], got

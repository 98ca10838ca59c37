"""The catalog of known failures (docs/vllm.md): one test per entry. Each builds the failure and
checks that it is reported on a CPU, in seconds, before any GPU job, with a message naming the
key or file and the fix.

Where an entry is about the INSTALLED vLLM the facts are real (`.venv-vllm`, gathered once for all
configs); API changes that vLLM 0.22 does not have are real facts modified with dataclasses.replace,
and for signature changes real Python classes with the changed signatures go through the same
inspection code (eyrie.vllm.facts.inspect_classes) as vLLM's own classes.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import re
import shutil
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from eyrie.arch.target import inspect_target, resolve_layer_ids
from eyrie.core import errors as pf_errors
from eyrie.core.errors import EvaluateError, ExportError, TargetError, VocabError
from eyrie.data.vocab import build_vocab
from eyrie.demo.tokenizer import build_chat_tokenizer
from eyrie.evaluate.vllm_check import check_draft_config
from eyrie.export.export import export
from eyrie.preflight import checks as pf_checks
from eyrie.preflight import preflight as pf
from eyrie.preflight.vllm_checks import VllmTarget, vllm_checks
from eyrie.preflight.vllm_env import facts_for
from eyrie.vllm.adapters import llama_4_scaling
from eyrie.vllm.facts import VllmFacts, inspect_classes
from tests.support.train_helpers import train_settings
from tests.support.vllm_gpu_check import rehearsal_config
from tests.support.vllm_helpers import (
    DEEPSEEK,
    GPT_OSS,
    KIMI_K25,
    LLAMA,
    NO_VLLM,
    REPO,
    VLLM_ENVS,
    VLLM_PYTHON,
    need_vllm,
    real_facts,
    vllm_env,
    vllm_settings,
    write_target,
)

# entry -> where it is caught. "preflight": eyrie preflight (CPU, before every GPU job); the
# others are CPU stages that refuse in their first seconds.
CATALOG = {
    "embed_method_renamed": "preflight",
    "layer_extra_required_param": "preflight",
    "layer_positional_order": "preflight",
    "no_worker_extension": "preflight",
    "unsupported_vllm_version": "preflight",
    "no_native_method_or_connector": "preflight",
    "llama_4_scaling": "preflight",
    "multimodal_wrapper": "preflight",
    "deepseek_native_final_layer": "preflight",
    "draft_flag_vllm_ignores": "export stage",
    "aux_ids_off_by_one": "preflight",
    "all_zero_loss_mask": "preflight",
    "draft_vocab_too_large": "vocab stage",
    "disk_too_small": "preflight",
    "tensor_parallel_heads": "preflight",
    "weights_too_large": "preflight",
    "engine_memory_too_large": "preflight",
    "runner_switch_refused": "preflight",
    "moe_routing_config_missing": "preflight",
    "quantization_without_method": "preflight",
    "vllm_environment_missing": "preflight",
    "architecture_unknown_to_vllm": "preflight",
    "eval_target_without_eagle3": "preflight",
    "deepseek_final_layer_fixed": "preflight",
    "native_ids_unknown": "preflight",
    "hybrid_attention_states": "preflight",
    "model_runner_v2_default": "engine start",
    "draft_without_explicit_aux_ids": "vLLM evaluation stage",
    "quantization_package_missing": "preflight",
    "quantization_config_unparsable": "preflight",
    "config_unreadable_by_vllm": "preflight",
}
# entries whose test lives in another file: entry -> (file, test)
ELSEWHERE = {
    "quantization_package_missing": (
        "vllm/test_vllm_quantization.py",
        "test_vllm_environment_without_humming_is_a_problem_with_the_fix",
    ),
}
SETUP_FIX = "bash scripts/setup-vllm.sh"
ADAPTER_FIX = "update the adapter in eyrie/arch/registry.py"
H200 = {"tensor_parallel_size": 8, "gpu_memory_gib": 141}
KIMI_INT4_GIB = 595  # Kimi-K2.5's published weights (INT4 experts), as stored
# Kimi-K2.5's published quantization_config (text_config's: compressed-tensors, int4 experts)
KIMI_INT4 = json.loads((REPO / "tests" / "configs" / "kimi-k2.5-quantization.json").read_text())
GROUP_0 = KIMI_INT4["config_groups"]["group_0"]
# an abbreviated copy, as in a user's rehearsal: a config_groups entry without targets
NO_TARGETS = {
    **KIMI_INT4,
    "config_groups": {"group_0": {k: v for k, v in GROUP_0.items() if k != "targets"}},
}


def kimi_quantized(quantization: dict) -> dict:
    return {
        **KIMI_K25,
        "text_config": {**KIMI_K25["text_config"], "quantization_config": quantization},
    }


# configs that vLLM's own config classes parse in the gatherer (eyrie.vllm.facts.parse_config)
PARSED = {
    "kimi_int4": kimi_quantized(KIMI_INT4),
    "kimi_no_targets": kimi_quantized(NO_TARGETS),
    # a top-level quantization_config, and a second group without targets
    "llama_no_targets": {
        **LLAMA,
        "quantization_config": {
            **NO_TARGETS,
            "config_groups": {**NO_TARGETS["config_groups"], "group_1": GROUP_0, "group_2": {}},
        },
    },
    # yarn rope scaling without its factor
    "llama_yarn": {**LLAMA, "rope_scaling": {"rope_type": "yarn"}},
}


@functools.cache
def parsed_facts(version: str) -> dict[str, VllmFacts]:
    """The real facts of vLLM `version` for every PARSED config (one gatherer run)."""
    got = facts_for(vllm_env(version), list(PARSED.values()))
    return {name: VllmFacts.from_json(g) for name, g in zip(PARSED, got)}


@pytest.fixture(scope="module")
def facts():
    if not VLLM_PYTHON.is_file():
        pytest.skip(NO_VLLM)
    return real_facts()


def run_checks(
    tmp_path: Path,
    config: dict,
    facts,
    aux_ids=None,
    weights_gib=None,
    eval_vllm=False,
    longest=None,
    **vllm,
) -> dict:
    """vLLM preflight on a target folder holding `config` (and sparse weights of `weights_gib`);
    `longest`: the engines' longest sequences, as preflight reads them from the tokenize report."""
    folder = write_target(tmp_path / "target", config, weights_gib)
    info = inspect_target(folder)
    aux, final = resolve_layer_ids(aux_ids, info.num_hidden_layers)
    settings = vllm_settings(**vllm)
    settings["eval"]["vllm"] = eval_vllm
    target = VllmTarget(folder, info, aux, final, longest or {})
    return vllm_checks(target, settings, facts=facts)


def kimi_checks(tmp_path: Path, facts, config: dict = KIMI_K25, **vllm) -> dict:
    """run_checks on Kimi-K2.5 (or `config`) with its published weights' size and the installed
    vLLM's facts of Kimi."""
    return run_checks(tmp_path, config, facts["kimi"], weights_gib=KIMI_INT4_GIB, **vllm)


def one(problems: list[str], pattern: str) -> str:
    """The one problem matching `pattern` (a regex)."""
    hits = [p for p in problems if re.search(pattern, p)]
    assert len(hits) == 1, f"{pattern!r} in {problems}"
    return hits[0]


# Classes with the signatures vLLM had or may have; inspected, and their forwards run on stub
# layers, by the same code as vLLM's classes (eyrie.vllm.probe).
class DeepseekModelOldEmbed(torch.nn.Module):
    """vLLM < 0.12: embeddings through get_input_embeddings; states captured before each layer."""

    def get_input_embeddings(self, input_ids):
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
        hidden_states, residual = self.get_input_embeddings(input_ids), None
        aux_hidden_states = []
        for idx, layer in enumerate(self.layers):
            if idx in self.aux_hidden_state_layers:
                aux_hidden_states.append(hidden_states + residual)
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states, aux_hidden_states


class DeepseekModelFinalFix(DeepseekModelOldEmbed):
    """vLLM 0.26 on: the last layer's output is appended after the loop when asked for."""

    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
        hidden_states, residual = self.get_input_embeddings(input_ids), None
        aux_hidden_states = []
        for idx, layer in enumerate(self.layers):
            if idx in self.aux_hidden_state_layers:
                aux_hidden_states.append(hidden_states + residual)
            hidden_states, residual = layer(positions, hidden_states, residual)
        if self.end_layer in self.aux_hidden_state_layers:
            aux_hidden_states.append(hidden_states + residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states, aux_hidden_states


class DeepseekModelOpaque(DeepseekModelOldEmbed):
    """A forward that neither runs on stub layers (it needs vLLM's forward context) nor shows its
    capture in its source (it hands the loop to a helper)."""

    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
        return self.run_layers(self.forward_context(), input_ids, positions)


class DeepseekModelFutureEmbed(torch.nn.Module):
    """A future rename: neither known embedding method is there."""

    def embed_tokens_of(self, input_ids):
        return input_ids

    forward = DeepseekModelOldEmbed.forward


class DeepseekLayerToday(torch.nn.Module):
    def forward(self, positions, hidden_states, residual, llama_4_scaling=None):
        return hidden_states, residual


class DeepseekLayerExtraRequired(torch.nn.Module):
    def forward(self, positions, hidden_states, residual, attn_metadata, llama_4_scaling=None):
        return hidden_states, residual


class DeepseekLayerSwapped(torch.nn.Module):
    def forward(self, hidden_states, positions, residual, llama_4_scaling=None):
        return hidden_states, residual


class LlamaLayerSwapped(torch.nn.Module):
    def forward(self, hidden_states, positions, residual):
        return hidden_states, residual


def with_classes(real, model_cls=None, layer_cls=None):
    """Real facts with the fields of the given classes replaced, read by the same inspection code
    gather_facts runs on vLLM's classes (a class left None keeps its real fields)."""
    new = inspect_classes(model_cls, layer_cls)
    return replace(
        real,
        **{
            k: v
            for k, v in new.items()
            if (layer_cls if k.startswith("layer") else model_cls) is not None
        },
    )


def vllm_function(module: str, name: str) -> types.ModuleType:
    """vLLM's own function `name`, compiled from the INSTALLED
    vllm/model_executor/models/<module>.py into a module namespace here (the training
    environment has torch but no vLLM)."""
    source = next(
        VLLM_PYTHON.parent.parent.glob(
            f"lib/python*/site-packages/vllm/model_executor/models/{module}.py"
        )
    )
    tree = ast.parse(source.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    mod = types.ModuleType(f"vllm_{module}_{name}")
    mod.torch = torch
    exec(compile(ast.Module([fn], type_ignores=[]), str(source), "exec"), mod.__dict__)
    return mod


# ----------------------------------------------------------------------------- vLLM API changes


@pytest.mark.slow
@need_vllm
def test_embed_method_renamed(facts, tmp_path):
    # vLLM 0.12 renamed get_input_embeddings to embed_input_ids: either is driven, none is refused
    old = with_classes(facts["deepseek"], DeepseekModelOldEmbed, DeepseekLayerToday)
    assert old.embed_method == "get_input_embeddings" and old.native_ids == "1..N-1"
    got = run_checks(tmp_path / "old", DEEPSEEK, old, aux_ids=[1, 2, 3])
    assert got["problems"] == [] and got["report"]["extraction_path"]["chosen"] == "capture"
    new = with_classes(facts["deepseek"], model_cls=DeepseekModelFutureEmbed)
    got = run_checks(tmp_path / "new", DEEPSEEK, new, aux_ids=[1, 2, 3])
    problem = one(got["problems"], "has neither of")
    assert (
        "vllm.model_executor.models.deepseek_v2: DeepseekV2Model has neither of "
        "['embed_input_ids', 'get_input_embeddings']"
        in problem
        and ADAPTER_FIX in problem
    )


@pytest.mark.slow
@need_vllm
def test_layer_extra_required_param(facts, tmp_path):
    changed = with_classes(facts["deepseek"], layer_cls=DeepseekLayerExtraRequired)
    got = run_checks(tmp_path, DEEPSEEK, changed, aux_ids=[1, 2, 3])
    problem = one(got["problems"], "DeepseekV2DecoderLayer.forward")
    assert "required but not passed ['attn_metadata']" in problem
    assert "(positional order differs)" in problem and ADAPTER_FIX in problem


@pytest.mark.slow
@need_vllm
def test_layer_positional_order(facts, tmp_path):
    # DeepSeek's adapter calls positionally: a swapped order is refused ...
    swapped = with_classes(facts["deepseek"], layer_cls=DeepseekLayerSwapped)
    got = run_checks(tmp_path / "ds", DEEPSEEK, swapped, aux_ids=[1, 2, 3])
    problem = one(got["problems"], "positional order differs")
    assert (
        "DeepseekV2DecoderLayer.forward('hidden_states', 'positions', 'residual', "
        "'llama_4_scaling') does not match the adapter's positional call" in problem
    )
    # ... Llama's calls by keyword, so the same swap is harmless there
    llama = with_classes(facts["llama"], layer_cls=LlamaLayerSwapped)
    got = run_checks(tmp_path / "llama", LLAMA, llama, extraction_path="capture")
    assert got["problems"] == []
    # and the real 0.22 classes pass
    real = run_checks(tmp_path / "real", DEEPSEEK, facts["deepseek"], aux_ids=[1, 2, 3])
    assert real["problems"] == []


@pytest.mark.slow
@need_vllm
def test_no_worker_extension(facts, tmp_path):
    gone = replace(facts["deepseek"], worker_extension=False)
    got = run_checks(tmp_path / "ds", DEEPSEEK, gone, aux_ids=[1, 2, 3])
    problem = one(got["problems"], "neither extraction path works")
    assert "no worker_extension_cls, so the capture path cannot install itself" in problem
    assert ADAPTER_FIX in problem and SETUP_FIX in problem
    # Llama keeps the native path, which needs no worker extension
    got = run_checks(tmp_path / "llama", LLAMA, replace(facts["llama"], worker_extension=False))
    assert got["problems"] == [] and got["report"]["extraction_path"]["chosen"] == "native"


@pytest.mark.slow
@need_vllm
@pytest.mark.parametrize("version", ["0.17.1", "0.35.0"])
def test_unsupported_vllm_version(facts, tmp_path, version):
    got = run_checks(tmp_path, LLAMA, replace(facts["llama"], version=version))
    problem = one(got["problems"], "outside the supported range")
    assert f"vLLM {version} is outside the supported range [0.18.0, 0.35.0)" in problem
    assert SETUP_FIX in problem and "vllm.python" in problem
    # ... and every other check still ran and says what it found
    report = got["report"]
    assert report["extraction_path"]["chosen"] == ("capture" if version < "0.18" else "native")
    assert report["memory"] is not None and report["adapter"] == "llama"


@pytest.mark.slow
@need_vllm
def test_untested_vllm_version_warns(facts, tmp_path):
    # inside the range but never tested: a warning; tested on a CPU only: a warning saying so
    for version, says in [("0.30.0", "untested"), ("0.33.0", "tested on a CPU only")]:
        got = run_checks(tmp_path / version, LLAMA, replace(facts["llama"], version=version))
        assert got["problems"] == [] and says in one(got["warnings"], f"vLLM {version}")
    got = run_checks(tmp_path / "gpu", LLAMA, replace(facts["llama"], version="0.26.0"))
    assert not [w for w in got["warnings"] if "vLLM 0.26.0" in w]


@pytest.mark.slow
@need_vllm
def test_no_native_method_or_connector(facts, tmp_path):
    gone = replace(facts["llama"], native_method=False, native_connector=False)
    got = run_checks(tmp_path / "auto", LLAMA, gone)
    path = got["report"]["extraction_path"]
    assert got["problems"] == [] and path["chosen"] == "capture"
    assert "speculative method 'extract_hidden_states' not found" in path["native_refused"][0]
    assert "KV connector ExampleHiddenStatesConnector not registered" in path["native_refused"][1]
    got = run_checks(tmp_path / "native", LLAMA, gone, extraction_path="native")
    assert len(got["problems"]) == 2
    assert all(
        p.startswith(f"vllm.extraction_path=native: vLLM {facts['llama'].version}: ")
        and p.endswith("set vllm.extraction_path to capture or auto")
        for p in got["problems"]
    )


# ----------------------------------------------------------------------------- configs


@pytest.mark.slow
@need_vllm
def test_llama_4_scaling(facts, tmp_path):
    # the function, on real torch positions, with vLLM's own helper from the installed source
    module = vllm_function("deepseek_v2", "_get_llama_4_scaling")
    positions = torch.tensor([0, 1, 8191, 8192, 8193, 20000, 65535, 131072])  # [T]
    spec = {"original_max_position_embeddings": 8192, "beta": 0.1}
    got = llama_4_scaling(transformers.PretrainedConfig(llama_4_scaling=spec), positions, module)
    assert got.shape == (8, 1, 1)  # broadcast over heads and head_dim
    want = 1 + 0.1 * torch.log(1 + torch.floor(positions / 8192))
    torch.testing.assert_close(got[:, 0, 0], want)
    assert got[0, 0, 0].item() == 1.0 and got[3, 0, 0].item() == pytest.approx(
        1 + 0.1 * math.log(2)
    )
    assert got[7, 0, 0].item() == pytest.approx(1 + 0.1 * math.log(17))
    assert llama_4_scaling(transformers.PretrainedConfig(), positions, module) is None  # Kimi-K2.5

    # preflight: without the key nothing is needed; with it, vLLM's helper (0.22 has it)
    with_key = {**DEEPSEEK, "llama_4_scaling": spec}
    assert (
        run_checks(tmp_path / "a", with_key, facts["deepseek"], aux_ids=[1, 2, 3])["problems"] == []
    )
    no_helper = replace(
        facts["deepseek"],
        helpers={"llama_4_scaling": False},
        helper_params={"llama_4_scaling": None},
    )
    assert run_checks(tmp_path / "b", DEEPSEEK, no_helper, aux_ids=[1, 2, 3])["problems"] == []
    got = run_checks(tmp_path / "c", with_key, no_helper, aux_ids=[1, 2, 3])
    problem = one(got["problems"], "llama_4_scaling")
    assert "config asks for llama_4_scaling but this vLLM has no _get_llama_4_scaling" in problem
    renamed = replace(
        facts["deepseek"],
        helper_params={
            "llama_4_scaling": ["original_max_position_embeddings", "beta", "positions"]
        },
    )
    got = run_checks(tmp_path / "d", with_key, renamed, aux_ids=[1, 2, 3])
    assert "does not take the keywords" in one(got["problems"], "_get_llama_4_scaling")
    bad = {**DEEPSEEK, "llama_4_scaling": {"beta": 0.1}}
    got = run_checks(tmp_path / "e", bad, facts["deepseek"], aux_ids=[1, 2, 3])
    assert (
        "config.json: llama_4_scaling={'beta': 0.1} needs keys original_max_position_embeddings "
        "and beta; fix the target's config" in got["problems"]
    )


@pytest.mark.slow
@need_vllm
def test_multimodal_wrapper(facts, tmp_path):
    got = run_checks(tmp_path / "ok", KIMI_K25, facts["kimi"], weights_gib=KIMI_INT4_GIB, **H200)
    assert got["problems"] == [], got["problems"]
    report = got["report"]
    assert report["adapter"] == "deepseek" and report["facts"]["model_type"] == "kimi_k2"
    assert report["facts"]["architecture_class"] == "KimiK25ForConditionalGeneration"
    assert report["extraction_path"]["layer_ids"] == [2, 30, 58, 61]  # N = text_config's 61
    info = inspect_target(tmp_path / "ok" / "target")
    assert (info.hidden_size, info.num_hidden_layers, info.num_attention_heads) == (7168, 61, 64)
    # MoE routing keys are read from text_config: at the top level they do not count
    text = {k: v for k, v in KIMI_K25["text_config"].items() if k != "scoring_func"}
    moved = {**KIMI_K25, "scoring_func": "sigmoid", "text_config": text}
    got = run_checks(tmp_path / "moved", moved, facts["kimi"], weights_gib=KIMI_INT4_GIB, **H200)
    assert "config.json: text_config.scoring_func missing" in one(got["problems"], "scoring_func")


@pytest.mark.slow
@need_vllm
def test_deepseek_native_final_layer(facts, tmp_path):
    # vLLM 0.22 captures DeepSeek states BEFORE each layer: id N (the training targets) never comes
    assert facts["kimi"].native_ids == facts["deepseek"].native_ids == "1..N-1"
    got = kimi_checks(tmp_path / "native", facts, extraction_path="native", **H200)
    problem = one(got["problems"], "never returned")
    assert problem == (
        "vllm.extraction_path=native: vLLM 0.22.0: the kimi_k2 model captures states "
        "BEFORE each layer (ids 1..60), so id 61 (the last layer's output, which the "
        "training targets need) is never returned; set vllm.extraction_path to "
        "capture or auto"
    )
    got = kimi_checks(tmp_path / "auto", facts, **H200)
    path = got["report"]["extraction_path"]
    assert got["problems"] == [] and path["chosen"] == "capture"
    assert "id 61" in path["native_refused"][0]
    # Llama captures after each layer: native works and auto takes it
    assert facts["llama"].native_ids == "0..N"
    assert (
        run_checks(tmp_path / "llama", LLAMA, facts["llama"])["report"]["extraction_path"]["chosen"]
        == "native"
    )


@pytest.mark.slow
@need_vllm
def test_draft_flag_vllm_ignores(facts, tmp_path):
    # the installed vLLM's speculators converter does not carry these two flags into the draft ...
    fields = facts["llama"].eagle3_draft_fields
    assert "norm_before_residual" in fields and "draft_vocab_size" in fields
    assert "norm_output" not in fields and "fc_norm" not in fields
    # ... so export refuses a draft trained with either (its real function, before loading anything)
    target = write_target(tmp_path / "target", LLAMA)
    for flag in ("norm_output", "fc_norm"):
        train_dir = tmp_path / flag
        (train_dir / "draft").mkdir(parents=True)
        (train_dir / "draft" / "config.json").write_text(json.dumps({flag: True}))
        (train_dir / "draft" / "model.safetensors").write_bytes(b"")
        (train_dir / "train.json").write_text("{}")
        with pytest.raises(ExportError) as err:
            export(target, train_dir, tmp_path / "out", train_settings())
        assert str(err.value).startswith(
            f"{train_dir / 'draft' / 'config.json'}: {flag} is true, "
            f"but vLLM 0.22 does not read {flag}"
        )
        assert str(err.value).endswith(f"; retrain with {flag} off")
        assert not (tmp_path / "out").exists()


def test_aux_ids_off_by_one(tmp_path):
    # HF-style "last hidden state" id N given as an aux id, and id 0 (the embeddings)
    with pytest.raises(
        TargetError,
        match=r"layers\.aux_ids=\[2, 30, 61\]: id 61 is out of range for "
        r"a 61-layer target; set layers\.aux_ids to strictly "
        r"increasing ids within 1\.\.60",
    ):
        resolve_layer_ids([2, 30, 61], 61)
    with pytest.raises(TargetError, match="id 0 is out of range"):
        resolve_layer_ids([0, 30, 58], 61)
    # through preflight, with the tiny-target default formula named
    folder = write_target(tmp_path / "t", {**LLAMA, "num_hidden_layers": 4})
    with pytest.raises(
        pf_errors.PreflightError, match=r"default \[2, N//2, N-3\] = \[2, 2, 1\] for N=4"
    ):
        pf.preflight(folder, None, tmp_path, {})


def test_all_zero_loss_mask(tmp_path):
    # a template that renders assistant turns as a bare newline: their text is hidden, so no token
    # of the rendering belongs to an assistant turn
    tok = build_chat_tokenizer(["What does json.dumps do? Seven. Eleven."] * 20, 300)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '\\n' }}"
        "{% else %}{{ m['content'] + '\\n' }}{% endif %}{% endfor %}"
    )
    tok.save_pretrained(tmp_path)
    check = pf_checks.Check([], [])
    pf_checks.check_tokenizer(tmp_path, False, check)
    assert check.problems == [  # one line for the target, whatever each conversation shows
        f"{tmp_path}: the chat template trains no assistant turn of any sample conversation "
        "(empty_turn: the template renders no text for the turn (assistant turn 1 renders no "
        "text)); the template must render assistant turns so their text can be located "
        "(docs/data.md#the-loss-mask)"
    ]


def test_draft_vocab_too_large(tmp_path):
    folder = write_target(tmp_path / "t", LLAMA)  # vocab_size 320
    with pytest.raises(VocabError) as err:
        build_vocab(
            folder,
            [tmp_path / "shard_000.parquet"],
            tmp_path / "vocab.safetensors",
            {"vocab": {"draft_vocab_size": 512}},
        )
    assert str(err.value) == (
        f"vocab.draft_vocab_size=512 is larger than the target vocabulary "
        f"(320 in {folder / 'config.json'}); set it <= 320"
    )
    assert not (tmp_path / "vocab.safetensors").exists()


def test_disk_too_small(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    per_token = 4 * 7168 * 2  # Kimi: 3 aux + final, bf16
    tokens = 2 * free // per_token  # twice what fits on this disk
    check = pf_checks.Check([], [])
    volume = pf_checks.HiddenVolume(tokens, 4, 7168, "bfloat16")
    pf_checks.check_storage(volume, tmp_path / "results" / "hidden", check)
    (problem,) = check.problems
    assert problem.startswith(f"{tmp_path}: hidden states need ~")
    assert f"({tokens} tokens x {per_token} B/token)" in problem
    assert "free disk, use fewer conversations or a smaller extract.storage_dtype" in problem


@pytest.mark.slow
@need_vllm
def test_tensor_parallel_heads(facts, tmp_path):
    got = kimi_checks(tmp_path, facts, tensor_parallel_size=6, gpu_memory_gib=141)
    problem = one(got["problems"], "does not divide")
    assert problem == (
        "vllm.tensor_parallel_size=6 does not divide config.json: "
        "text_config.num_attention_heads=64; use one of [1, 2, 4, 8, 16, 32, 64]"
    )


@pytest.mark.slow
@need_vllm
def test_weights_too_large(facts, tmp_path):
    got = kimi_checks(tmp_path, facts, tensor_parallel_size=8, gpu_memory_gib=80)
    problem = one(got["problems"], "weights need")
    assert "the weights need ~595.0 GiB (1 *.safetensors file(s)" in problem
    assert (
        "vllm.tensor_parallel_size=8 x vllm.gpu_memory_gib=80 x vllm.gpu_memory_utilization=0.85"
        " = 544.0 GiB leaves 435.2 GiB for them (80%" in problem
    )
    # 11 GPUs of 80 GiB would hold the weights, but 64 heads allow 16
    assert "use vllm.tensor_parallel_size=16 (GPUs of that memory) or larger GPUs" in problem
    assert got["report"]["memory"]["fits"] is False


@pytest.mark.slow
@need_vllm
def test_engine_memory_too_large(facts, tmp_path):
    """The rehearsal of issue 38 on an 80 GB H100: Kimi-K2.5 cut to 4 layers at full width, its
    384 int4 experts (~32.7 GiB, which fit), with vLLM's own max_model_len, the target's context
    of 262,144 tokens: without chunked prefill vLLM profiles a step that long, and ran out of GPU
    memory after the model load. Preflight predicts it; lengths from the data fit."""
    config = rehearsal_config("kimi_k25_int4")
    config["text_config"]["max_position_embeddings"] = 262144  # Kimi-K2.5's
    # data.max_seq_len 384 + the asked token and the spec slot
    kimi4 = functools.partial(
        run_checks,
        config=config,
        facts=facts["kimi"],
        aux_ids=[1, 2, 3],
        longest={"extraction": 386},
    )
    got = kimi4(tmp_path / "context", max_model_len=262144)
    problem = one(got["problems"], "extraction engine would ask")
    assert problem.startswith("vllm: the extraction engine would ask for ~")
    assert "for max_num_batched_tokens=262144" in problem
    assert "one max_model_len=262144 sequence" in problem and "vllm.max_model_len" in problem
    assert "but vllm.gpu_memory_gib=80 x vllm.gpu_memory_utilization=0.85 = 68.0 GiB" in problem
    assert "use vllm.max_model_len: null (now 262144; the data need 386) or a smaller " in problem
    assert "vllm.max_num_batched_tokens (now 262144) or a higher" in problem
    assert got["report"]["memory"]["extraction"]["fits"] is False
    # the default (null): the longest tokenized sample; a step of BATCH_TOKENS
    got = kimi4(tmp_path / "data")
    assert not got["problems"], got["problems"]
    engine = got["report"]["engine"]["extraction"]
    assert engine == {
        "max_model_len": 386,
        "max_num_batched_tokens": 16384,
        "max_num_seqs": 256,
        "from": "the longest tokenized sample",
    }
    predicted = got["report"]["memory"]["extraction"]
    assert predicted["fits"] and 32 < predicted["weights_gib"] < 33.5
    # a step smaller than one sample: vLLM refuses to start without chunked prefill
    got = kimi4(tmp_path / "step", max_model_len=8192, max_num_batched_tokens=4096)
    assert one(got["problems"], "max_num_batched_tokens=4096 is below").endswith(
        "raise it to at least max_model_len or leave it null"
    )


@pytest.mark.slow
@need_vllm
def test_moe_routing_config_missing(facts, tmp_path):
    bare = {k: v for k, v in DEEPSEEK.items() if k not in ("scoring_func", "topk_method")}
    got = run_checks(tmp_path / "bare", bare, facts["deepseek"], aux_ids=[1, 2, 3])
    assert (
        "config.json: scoring_func missing: vLLM's deepseek model needs it to build the MoE "
        "routing (use ['sigmoid', 'softmax'])" in got["problems"]
    )
    assert one(got["problems"], "topk_method missing")
    got = run_checks(
        tmp_path / "odd", {**DEEPSEEK, "scoring_func": "tanh"}, facts["deepseek"], aux_ids=[1, 2, 3]
    )
    assert (
        "config.json: scoring_func='tanh': vLLM's deepseek model supports ['sigmoid', 'softmax']"
        in got["problems"]
    )


@pytest.mark.slow
@need_vllm
def test_quantization_without_method(facts, tmp_path):
    text = {**KIMI_K25["text_config"], "quantization_config": {"format": "pack-quantized"}}
    got = kimi_checks(tmp_path, facts, {**KIMI_K25, "text_config": text}, **H200)
    problem = one(got["problems"], "quant_method")
    assert problem.startswith("config.json: text_config.quantization_config has no quant_method")
    assert "add the method the checkpoint was quantized with" in problem
    assert got["report"]["quantization"] == {
        "quant_method": None,
        "where": "text_config.quantization_config",
    }


@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(VLLM_ENVS))
def test_quantization_config_unparsable(version, tmp_path):
    # vLLM's CompressedTensorsConfig.from_config reads every config_groups entry's targets: the
    # abbreviated config failed in the GPU job (KeyError: 'targets'); the gatherer parses it with
    # the installed vLLM's own class on the CPU
    facts = parsed_facts(version)
    published = facts["kimi_int4"].quantization_parse
    assert published["ok"] is True and published["class"] == "CompressedTensorsConfig"
    kimi = {"weights_gib": KIMI_INT4_GIB, **H200}
    got = run_checks(tmp_path / "published", PARSED["kimi_int4"], facts["kimi_int4"], **kimi)
    assert got["problems"] == [] and got["report"]["quantization"]["parse"]["ok"] is True
    fix = (
        "as the checkpoint's publisher ships them (copy quantization_config from the original "
        "config.json)"
    )
    got = run_checks(tmp_path / "no", PARSED["kimi_no_targets"], facts["kimi_no_targets"], **kimi)
    assert got["problems"] == [
        "config.json: text_config.quantization_config.config_groups.group_0: "
        f"vLLM {version}'s CompressedTensorsConfig.from_config fails: KeyError: 'targets'; "
        f"give every config_groups entry the keys vLLM reads (group_0 lacks 'targets') {fix}"
    ]
    got = run_checks(tmp_path / "llama", PARSED["llama_no_targets"], facts["llama_no_targets"])
    assert one(got["problems"], "from_config") == (
        "config.json: quantization_config.config_groups: "
        f"vLLM {version}'s CompressedTensorsConfig.from_config fails: KeyError: 'targets'; "
        f"give every config_groups entry the keys vLLM reads (group_0, group_2 lack 'targets') "
        f"{fix}"
    )
    # a parse of another config is not used
    got = run_checks(tmp_path / "other", PARSED["kimi_no_targets"], facts["kimi_int4"], **kimi)
    assert got["problems"] == [] and "parse" not in got["report"]["quantization"]


@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(VLLM_ENVS))
def test_config_unreadable_by_vllm(version, tmp_path):
    # vLLM's ModelConfig (its HF config, architecture, quantization method, context length)
    # raises at engine start: the gatherer builds it from config.json on the CPU
    facts = parsed_facts(version)
    assert facts["kimi_int4"].config_parse["ok"] is True
    got = run_checks(tmp_path / "yarn", PARSED["llama_yarn"], facts["llama_yarn"])
    problem = one(got["problems"], "ModelConfig")
    assert problem.startswith(
        f"{tmp_path / 'yarn' / 'target' / 'config.json'}: rope_scaling: vLLM {version} cannot "
        "read it (vllm.config.ModelConfig fails: KeyError: "
    )
    assert "{'factor'}" in problem and problem.endswith(
        "; write rope_scaling as the model's publisher ships it (copy it from the original "
        "config.json)"
    )
    assert len(got["problems"]) == 1
    # the same facts for a config they were not gathered for say nothing
    assert run_checks(tmp_path / "llama", LLAMA, facts["llama_yarn"])["problems"] == []


def test_vllm_environment_missing(tmp_path):
    import sys

    for python, expect in (
        (tmp_path / "none" / "python", "no vLLM environment there"),
        (Path(sys.executable), "No module named 'vllm'"),
    ):
        folder = write_target(tmp_path / python.parent.name, LLAMA)
        info = inspect_target(folder)
        target = VllmTarget(folder, info, [2, 4, 5], 8)
        got = vllm_checks(target, vllm_settings(python=str(python)))
        problem = one(got["problems"], "vllm.python")
        assert expect in problem and SETUP_FIX in problem, problem


@pytest.mark.slow
@need_vllm
def test_architecture_unknown_to_vllm(facts, tmp_path):
    got = run_checks(
        tmp_path, {**LLAMA, "architectures": ["LlamaNextForCausalLM"]}, facts["unknown_arch"]
    )
    assert (
        f"{tmp_path / 'target' / 'config.json'}: architectures[0]='LlamaNextForCausalLM' is not a "
        "model vLLM 0.22.0 knows; use a vLLM that supports it" in got["problems"]
    )


@pytest.mark.slow
@need_vllm
def test_eval_target_without_eagle3(facts, tmp_path):
    got = run_checks(tmp_path, LLAMA, replace(facts["llama"], eagle3_target=False), eval_vllm=True)
    problem = one(got["problems"], "eval.vllm")
    assert "cannot be an EAGLE-3 target (no set_aux_hidden_state_layers" in problem
    assert "set eval.vllm: false" in problem


@pytest.mark.slow
@need_vllm
def test_deepseek_final_layer_fixed(facts, tmp_path):
    # the fix (vLLM 0.26 on): the forward appends id N after the loop; running it on stub layers
    # finds ids 1..N, so native returns every id Kimi-K2.5 needs and auto takes it
    fixed = with_classes(facts["kimi"], DeepseekModelFinalFix)
    assert fixed.native_ids == "1..N" and fixed.native_ids_how.startswith("forward run")
    got = run_checks(tmp_path, KIMI_K25, fixed, weights_gib=KIMI_INT4_GIB, **H200)
    path = got["report"]["extraction_path"]
    assert got["problems"] == [] and path["chosen"] == "native"
    assert path["layer_ids"] == [2, 30, 58, 61]


@pytest.mark.slow
@need_vllm
def test_native_ids_unknown(facts, tmp_path):
    # neither the stub run nor the source tells which ids come back: unknown, never guessed
    opaque = with_classes(facts["deepseek"], DeepseekModelOpaque)
    assert opaque.native_ids is None
    assert opaque.native_ids_how.startswith("unknown: no loop over the decoder layers")
    assert "the stub forward failed: AttributeError" in opaque.native_ids_how
    got = run_checks(
        tmp_path / "native", DEEPSEEK, opaque, aux_ids=[1, 2, 3], extraction_path="native"
    )
    problem = one(got["problems"], "is unknown")
    assert "which ids the deepseek_v3 model's forward returns is unknown" in problem
    assert "run tests/support/vllm_gpu_check.py on a GPU" in problem
    got = run_checks(tmp_path / "auto", DEEPSEEK, opaque, aux_ids=[1, 2, 3])
    assert got["problems"] == [] and got["report"]["extraction_path"]["chosen"] == "capture"


@pytest.mark.slow
@need_vllm
def test_hybrid_attention_states(facts, tmp_path):
    # a connector that copies finished requests' states without finding its own KV-cache group
    # (the design vLLM PR #46301 fixed) reads zeros for a target whose layers fall into several
    # groups (gpt-oss: sliding-window and full attention)
    wrong = replace(facts["gpt_oss"], native_hybrid=False, native_hybrid_how="the bug")
    got = run_checks(tmp_path / "auto", GPT_OSS, wrong, aux_ids=[1, 2, 3])
    path = got["report"]["extraction_path"]
    assert got["problems"] == [] and path["chosen"] == "capture"
    assert (
        "this target's layers are of several kinds (full_attention, sliding_attention), and "
        "whether the hidden-states connector reads their states from the right KV-cache group "
        "reads them wrongly (the bug)" in path["native_refused"][0]
    )
    # the installed vLLM's own connector (run on stand-in groups or read by its design) is right
    assert facts["gpt_oss"].native_hybrid is True
    got = run_checks(tmp_path / "real", GPT_OSS, facts["gpt_oss"], aux_ids=[1, 2, 3])
    assert got["report"]["extraction_path"]["chosen"] == "native"


@pytest.mark.slow
@need_vllm
def test_model_runner_v2_default(facts):
    # vLLM's default runner per architecture is a fact (V2 for dense targets from 0.26 on); eyrie's
    # engines set no runner of their own: they run on vLLM's choice, or the user's
    assert facts["llama"].default_runner in ("v1", "v2")
    assert facts["llama"].default_runner_how.startswith("VllmConfig.use_v2_model_runner")


@pytest.mark.slow
@need_vllm
def test_runner_switch_refused(facts, tmp_path, monkeypatch):
    """vLLM 0.34 deleted the V1 model runner, and its check of the environment at every engine's
    start refuses VLLM_USE_V2_MODEL_RUNNER=0, which eyrie's engines used to set: they set no
    runner now (the gatherer asks vLLM's own check, facts engine_env_refused), and where the
    user's environment sets it, preflight says so in one line. The refusal is 0.34's message,
    put on 0.22's facts."""
    refused = (
        "VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported: Model Runner V1 has been removed. "
        "Unset this variable."
    )
    gone = replace(facts["llama"], version="0.34.0", engine_env_refused=refused)
    got = run_checks(tmp_path, LLAMA, gone)
    assert one(got["problems"], "refuses the environment") == (
        f"vLLM 0.34.0 refuses the environment its engines would start in: {refused} (the jobs "
        "inherit the environment snakemake runs in: unset the variable there, or in the "
        "profile's env)"
    )
    # eyrie's own engines set no switch: its facts are read on the user's environment alone
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert facts["llama"].engine_env_refused is None


@pytest.mark.slow
@need_vllm
def test_draft_without_explicit_aux_ids(facts, tmp_path):
    # vLLM falls back to the architecture's default aux layers (2, N/2, N-3) only when a draft
    # carries no eagle_aux_hidden_state_layer_ids; its converter carries the field in every
    # tested version, export always writes it (tests/export/test_export.py), and the vLLM evaluation
    # refuses a draft without it
    assert "eagle_aux_hidden_state_layer_ids" in facts["kimi"].eagle3_draft_fields
    assert facts["kimi"].eagle3_default_layers == "get_eagle3_default_aux_hidden_state_layers"
    info = inspect_target(write_target(tmp_path / "target", LLAMA))
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    (draft / "model.safetensors").write_bytes(b"")
    with pytest.raises(EvaluateError) as err:
        check_draft_config(draft, info)
    assert str(err.value).startswith(f"{draft / 'config.json'}: vLLM would not serve this draft")
    assert "eagle_aux_hidden_state_layer_ids None must be a non-empty list of layer ids" in str(
        err.value
    )


# ----------------------------------------------------------------------------- the catalog itself


def test_every_entry_has_its_test():
    names = {
        n[len("test_") :] for n, f in globals().items() if n.startswith("test_") and callable(f)
    }
    assert set(CATALOG) - set(ELSEWHERE) <= names, sorted(set(CATALOG) - names)
    for entry, (file, test) in ELSEWHERE.items():
        assert f"def {test}(" in (REPO / "tests" / file).read_text(), entry


def test_docs_table_is_the_catalog():
    """docs/vllm.md lists exactly these entries, each caught where this file says, and its count
    line matches."""
    text = (REPO / "docs" / "vllm.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \|[^|]*\| ([^|]+?) \|", text, re.M)
    assert dict(rows) == CATALOG
    caught = sum(where == "preflight" for where in CATALOG.values())
    assert f"{len(CATALOG)} entries; preflight catches {caught} of them on a CPU" in text

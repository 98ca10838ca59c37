"""Preflight's vLLM part: the environment subprocess, sizes, memory, tensor parallelism,
quantization, the rule's settings, and whole preflight runs against the REAL installed vLLM.
(The catalog of known failures is tests/vllm/test_failure_catalog.py.)"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys

import pytest
import torch
import transformers

from eyrie.arch.target import inspect_target
from eyrie.cli import main
from eyrie.config.sections import VllmSettings
from eyrie.preflight import preflight as pf
from eyrie.preflight import vllm_checks as vp
from eyrie.preflight import vllm_config, vllm_env, vllm_sizing
from tests.support import TESTS
from tests.support.stages import eyrie_cmd, stage_args
from tests.support.vllm_helpers import (
    DEEPSEEK,
    KIMI_K25,
    LLAMA,
    NO_VLLM,
    REPO,
    VLLM_PYTHON,
    need_vllm,
    real_facts,
    vllm_settings,
    write_target,
)


@pytest.fixture(scope="module")
def facts():
    if not VLLM_PYTHON.is_file():
        pytest.skip(NO_VLLM)
    return real_facts()


# ----------------------------------------------------------------------------- settings


# the compared and runtime settings of preflight: tests/config/test_config.py


def test_no_vllm_no_vllm_object(chat_target_4_heads, tmp_path):
    report = pf.preflight(chat_target_4_heads, None, tmp_path, {})
    assert report["vllm"] is None


# ----------------------------------------------------------------------------- sizes and memory


def _params_without_norms(model) -> int:
    """Parameters count_parameters estimates: all but norms and the router's score bias."""
    return sum(
        p.numel()
        for n, p in model.named_parameters()
        if "norm" not in n and "e_score_correction_bias" not in n
    )


@pytest.mark.parametrize("config", [LLAMA, DEEPSEEK], ids=["llama", "deepseek_v3"])
def test_count_parameters_matches_transformers(config):
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert vllm_sizing.count_parameters(config) == _params_without_norms(model)


def test_count_parameters_kimi_is_one_trillion():
    n = vllm_sizing.count_parameters(KIMI_K25["text_config"])
    assert 1.00e12 < n < 1.06e12, n  # Kimi-K2: "1T total parameters"


def test_weight_bytes_from_files_then_config(tmp_path):
    folder = write_target(tmp_path / "t", LLAMA, weights_gib=0.5)
    w = vllm_sizing.weight_bytes(folder, LLAMA)
    assert w["bytes"] == 2**29 and "1 *.safetensors" in w["source"] and not w["upper_bound"]
    (folder / "model.safetensors").unlink()
    w = vllm_sizing.weight_bytes(folder, LLAMA)
    assert w["bytes"] == vllm_sizing.count_parameters(LLAMA) * 2 and "architecture" in w["source"]
    fp8 = {**LLAMA, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    sized = vllm_sizing.weight_bytes(folder, fp8)
    assert not sized["upper_bound"] and sized["bytes"] < vllm_sizing.count_parameters(LLAMA) * 2
    unknown = {**LLAMA, "quantization_config": {"quant_method": "someday"}}
    assert vllm_sizing.weight_bytes(folder, unknown)["upper_bound"] is True


def test_weights_sized_from_the_architecture_and_its_quantization(tmp_path):
    """Kimi-K2.5 as published: 1.03 T parameters, routed experts in int4 (group 32, bf16 scales),
    the rest bf16: its 64 files hold 595 GB (554 GiB). Files holding under a tenth of that are a
    copy in progress: the estimate is used and said so."""
    config = json.loads(json.dumps(KIMI_K25))
    quant = json.loads((TESTS / "configs" / "kimi-k2.5-quantization.json").read_text())
    config["text_config"]["quantization_config"] = quant
    folder = write_target(tmp_path / "kimi", config)
    w = vllm_sizing.weight_bytes(folder, config)
    assert 540 < w["bytes"] / vllm_sizing.GIB < 570
    assert "compressed-tensors at 4.5 bits" in w["source"]
    bf16 = vllm_sizing.weight_bytes(folder, KIMI_K25)["bytes"]
    assert 1900 < bf16 / vllm_sizing.GIB < 1930
    write_target(folder, config, weights_gib=20)  # 20 of 554 GiB downloaded (< 10%)
    v = VllmSettings.from_section(
        {"tensor_parallel_size": 8, "gpu_memory_gib": 140, "gpu_memory_utilization": 0.85}
    )
    est, problems, warnings = vllm_sizing.memory_check(folder, config, v)
    assert problems == [] and est["fits"] and 65 < est["weights_per_gpu_gib"] < 72
    assert len(warnings) == 1 and "hold 20.0 GiB of the ~55" in warnings[0]


def test_memory_budget_and_headroom(tmp_path):
    folder = write_target(tmp_path / "t", LLAMA, weights_gib=60)
    v = VllmSettings.from_section(
        {"tensor_parallel_size": 1, "gpu_memory_gib": 80, "gpu_memory_utilization": 0.85}
    )
    est, problems, _ = vllm_sizing.memory_check(folder, LLAMA, v)
    # 80 x 0.85 = 68 GiB; the weights may take 80% of it (54.4 GiB): 60 GiB does not fit
    assert est["budget_gib"] == 68.0 and not est["fits"] and est["min_tensor_parallel_size"] == 2
    assert len(problems) == 1 and "vllm.tensor_parallel_size=1" in problems[0]
    assert "use vllm.tensor_parallel_size=2" in problems[0]
    est, problems, _ = vllm_sizing.memory_check(
        folder, LLAMA, dataclasses.replace(v, tensor_parallel_size=2)
    )
    assert est["fits"] and problems == []


def test_tensor_parallel_rules_follow_vllm(tmp_path):
    folder = write_target(
        tmp_path / "t",
        {**LLAMA, "hidden_size": 48, "num_attention_heads": 12, "num_key_value_heads": 6},
    )
    info = inspect_target(folder)
    assert vllm_sizing.parallel_problems(info, 3) == []  # 12 % 3, 6 % 3
    assert vllm_sizing.parallel_problems(info, 12) == []  # KV heads replicated: 12 % 6 == 0
    (problem,) = vllm_sizing.parallel_problems(info, 4)  # 12 % 4 == 0 but 6 and 4 neither way
    assert "num_key_value_heads=6 can be neither split" in problem
    problems = vllm_sizing.parallel_problems(info, 5)
    assert (
        "does not divide config.json: num_attention_heads=12; use one of [1, 2, 3, 4, 6, 12]"
        in problems[0]
    )


@pytest.mark.slow
def test_quantization_reported_and_refused_only_when_unloadable(facts):
    assert vllm_config.quantization_check(LLAMA, facts["llama"]) == (None, [], [])
    ct = {
        **KIMI_K25,
        "text_config": {
            **KIMI_K25["text_config"],
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
            },
        },
    }
    report, problems, warnings = vllm_config.quantization_check(ct, facts["kimi"])
    assert report == {
        "quant_method": "compressed-tensors",
        "where": "text_config.quantization_config",
    }
    assert problems == warnings == []
    _, _, warnings = vllm_config.quantization_check(
        {**LLAMA, "quantization_config": {"quant_method": "x9"}}, facts["llama"]
    )
    assert "'x9' is not one of vLLM 0.22" in warnings[0]


def test_model_type_without_adapter_lists_the_supported(tmp_path, monkeypatch):
    from eyrie.arch import registry

    monkeypatch.setitem(
        registry.REGISTRY, "llama", dataclasses.replace(registry.REGISTRY["llama"], vllm=None)
    )
    folder = write_target(tmp_path / "t", LLAMA)
    target = vp.VllmTarget(folder, inspect_target(folder), [2, 4, 5], 8)
    got = vp.vllm_checks(target, vllm_settings())
    (problem,) = got["problems"]  # and no vLLM subprocess: nothing to check it against
    assert problem.startswith(
        f"{folder / 'config.json'}: model_type 'llama' has no vLLM adapter; "
        "supported: deepseek_v2, deepseek_v3, gpt_oss, kimi_k2, mistral"
    )
    assert got["report"]["facts"] is None


# ----------------------------------------------------------------------------- the environment


def test_missing_vllm_environment_is_a_problem_with_the_fix(tmp_path):
    folder = write_target(tmp_path / "t", LLAMA)
    info = inspect_target(folder)
    target = vp.VllmTarget(folder, info, [2, 4, 5], 8)
    got = vp.vllm_checks(target, vllm_settings(python=str(tmp_path / "nowhere" / "python")))
    (problem,) = [p for p in got["problems"] if "vllm.python" in p]
    assert "no vLLM environment there" in problem and "bash scripts/setup-vllm.sh" in problem


def test_environment_without_vllm_is_a_problem_with_the_fix():
    # the training environment has eyrie but no vLLM: a real, quick failure of the gatherer
    with pytest.raises(
        vllm_env.VllmEnvError, match=r"No module named 'vllm'.*bash scripts/setup-vllm\.sh"
    ):
        vllm_env.run_gatherer(sys.executable, [LLAMA])


def test_gatherer_timeout_is_a_problem():
    with pytest.raises(vllm_env.VllmEnvError, match=r"took more than 0 s"):
        vllm_env.run_gatherer(sys.executable, [LLAMA], timeout=0.01)


def test_relative_python_is_relative_to_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a Snakemake working directory elsewhere
    assert vllm_env.resolve_python(".venv-vllm/bin/python") == REPO / ".venv-vllm/bin/python"
    assert vllm_env.resolve_python(str(tmp_path / "py")) == tmp_path / "py"


# ----------------------------------------------------------------------------- whole preflight runs


@pytest.mark.slow
@need_vllm
def test_preflight_report_names_the_path(chat_target_4_heads, tmp_path, facts, caplog):
    out = tmp_path / "preflight.json"
    settings = vllm_settings()
    settings["eval"]["vllm"] = True
    with caplog.at_level(logging.INFO, logger="eyrie.preflight"):
        rc = main(stage_args("preflight", target=chat_target_4_heads, out=out, settings=settings))
    assert rc == 0
    v = json.loads(out.read_text())["vllm"]
    assert v["version"] == facts["llama"].version and v["adapter"] == "llama"
    assert v["used_for"] == ["extract", "eval"]
    assert v["extraction_path"]["chosen"] == "native"
    assert v["extraction_path"]["layer_ids"] == [2, 4, 5, 8]
    assert v["facts"]["native_ids"] == "0..N" and v["memory"]["fits"] is True
    assert v["python"] == str(VLLM_PYTHON)
    assert "extraction through the native path" in caplog.text


@pytest.mark.slow
@need_vllm
def test_capture_requested_is_used(chat_target_4_heads, tmp_path, facts):
    report = pf.preflight(
        chat_target_4_heads, None, tmp_path, vllm_settings(extraction_path="capture")
    )
    assert report["vllm"]["extraction_path"]["chosen"] == "capture"


@need_vllm
@pytest.mark.slow
def test_preflight_cli_as_the_rule_runs_it(chat_target_4_heads, tmp_path):
    """The whole stage as the rule runs it: a fresh process, vLLM's facts read in the vLLM
    environment (its time is BENCHMARKS.md's, not asserted here)."""
    out = tmp_path / "preflight.json"
    proc = subprocess.run(
        eyrie_cmd("preflight", target=chat_target_4_heads, out=out, settings=vllm_settings()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())["vllm"]["extraction_path"]["chosen"] == "native"
    assert "extraction through the native path" in proc.stderr


def test_ci_runs_the_readme_test_command_with_the_vllm_environment():
    """.ci/run's last line is the README's test command: the vLLM environments built, then the
    fast tier (the default `pytest`), then, once it passed, the slow tier."""
    command = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    fast = ".venv/bin/python -m pytest -q -p no:cacheprovider"
    assert "bash scripts/setup-vllm.sh" in command
    assert command.endswith(f' && {fast} && {fast} -m "(slow or slurm) and not gpu"')
    assert f"   {command}\n" in (REPO / "README.md").read_text()
    assert "|| true" not in command and "$?" not in command  # pytest's status (5 included) is CI's

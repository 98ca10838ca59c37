"""eyrie evaluate-vllm: settings, the refusal of drafts vLLM would serve differently (on a real
exported draft, before any engine starts), what the stage asks vLLM for and how it reports and
fails, vLLM's real counter classes -> AL, the module importing in the vLLM environment, the
workflow rule, and (marked gpu) the whole stage on a tiny target and draft through vLLM."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyrie import cli as cli
from eyrie.arch.draft import DraftSpec, build_draft
from eyrie.arch.target import fingerprint, read_config
from eyrie.config.schema import validate_config
from eyrie.config.sections import VllmSettings, vllm_runtime
from eyrie.core.errors import ConfigError, EvaluateError
from eyrie.core.io import LAST_GOOD
from eyrie.demo.tokenizer import build_chat_tokenizer
from eyrie.evaluate import vllm_check, vllm_compare, vllm_run
from eyrie.evaluate import vllm_eval as ev
from eyrie.evaluate.specdec import SAMPLE_SEED, SpecStats
from eyrie.export.export import export
from tests.support import REPO
from tests.support.models import random_model, random_vocab_map, save_target, tiny_llama
from tests.support.train_helpers import train_settings, write_eval_set, write_preflight

VLLM_PYTHON = Path(os.environ.get("EYRIE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "def f(x): return x + 1",
    "speculative decoding drafts tokens",
    "hidden states of the target model",
] * 8
AUX = [1, 2, 3]
K = 3
DRAFT_VOCAB = 64
MAX_NEW = 8
NUM_PROMPTS = 4


@pytest.fixture(autouse=True)
def installed_vllm_checked_elsewhere(request, monkeypatch):
    """The stage's installed-vLLM check imports vLLM, which this environment lacks: the tests that
    run the stage here replace it; test_installed_vllm_check_* run the real one in .venv-vllm."""
    if "vllm_env" not in request.keywords:
        monkeypatch.setattr(vllm_check, "check_installed_vllm", lambda *args: None)
    if "gpu" not in request.keywords:  # FakeEngines answer: no engine process to start
        monkeypatch.setattr(ev, "EngineWorkers", contextlib.nullcontext)


def settings(**overrides) -> dict:
    out = {
        "eval": {
            "num_speculative_tokens": K,
            "max_new_tokens": MAX_NEW,
            "num_prompts": NUM_PROMPTS,
            "device": "cpu",
        },
        "vllm": {
            "tensor_parallel_size": 1,
            "enforce_eager": True,
            "max_model_len": None,
            "gpu_memory_utilization": 0.3,
        },
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        out[section][key] = value
    return out


def write_target(root: Path, tok) -> Path:
    """A tiny Llama (head_dim 32, as the demo's; weights large enough for clear argmax margins in
    bfloat16) saved with `tok`."""
    config = tiny_llama(
        len(tok),
        tok,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return save_target(root / "target", random_model(config, std=0.3), tok)


def write_vocab(root: Path, tok) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A random vocabulary map of DRAFT_VOCAB entries that keeps eos: (file, d2t, t2d)."""
    return random_vocab_map(root / "vocab.safetensors", tok, DRAFT_VOCAB)


def write_draft(
    root: Path, target: Path, d2t: torch.Tensor, t2d: torch.Tensor, **train: object
) -> Path:
    """An (untrained) draft saved the way training saves it, then the real export. `train`:
    a block drafter's train settings (method, block_size, sample_from_anchor); its mask is the
    tokenizer's pad token (eyrie.arch.draft.mask_token)."""
    spec = DraftSpec(AUX)
    if train:
        pad = json.loads((target / "tokenizer_config.json").read_text()).get("pad_token")
        vocab = json.loads((target / "tokenizer.json").read_text())["model"]["vocab"]
        spec = DraftSpec(AUX, **train, mask_token_id=vocab[pad])
    build_draft(target, spec, d2t, t2d, seed=1).save_pretrained(root / "train" / "draft")
    (root / "train" / "train.json").write_text(
        json.dumps(
            {
                "run_id": "test",
                "aux_layer_ids": AUX,
                "target": {"fingerprint": fingerprint(read_config(target))},
            }
        )
    )
    draft = root / "draft"
    export(target, root / "train", draft, train_settings(ttt_steps=K, **train))
    return draft


def hf_evaluate(root: Path, files: dict) -> Path:
    """`eyrie evaluate` of the draft on `files` (target, draft, vocab, eval_set, preflight)."""
    hf_eval = root / "eval.json"
    argv = ["evaluate"]
    for key in ("target", "draft", "vocab", "eval_set", "preflight"):
        argv += ["--" + key.replace("_", "-"), str(files[key])]
    argv += ["--out", str(hf_eval), "--plot", str(root / "eval.png")]
    argv += ["--settings", json.dumps({"eval": settings()["eval"]})]
    assert cli.main(argv) == 0
    return hf_eval


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Llama target, a vocabulary map, eval prompts, a preflight report, a draft exported by
    `eyrie.export.export` and the Hugging Face evaluation of that draft (`eyrie evaluate`)."""
    root = tmp_path_factory.mktemp("evaluate_vllm")
    tok = build_chat_tokenizer(TEXTS, vocab_size=300)
    target = write_target(root, tok)
    vocab, d2t, t2d = write_vocab(root, tok)
    draft = write_draft(root, target, d2t, t2d)
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False
            )
        )
        for t in TEXTS[:NUM_PROMPTS]
    ]
    eval_set = write_eval_set(root / "eval.parquet", prompts)
    preflight = write_preflight(root / "preflight.json", target, AUX, 64, len(tok))
    files = {
        "target": target,
        "draft": draft,
        "vocab": vocab,
        "eval_set": eval_set,
        "preflight": preflight,
    }
    hf_eval = hf_evaluate(root, files)
    return {
        "root": root,
        "target": target,
        "draft": draft,
        "eval_set": eval_set,
        "hf_eval": hf_eval,
        "prompts": prompts,
        "eos": tok.eos_token_id,
    }


def stage_args(world, out: Path, draft: Path | None = None, **overrides) -> list[str]:
    return [
        "evaluate-vllm",
        "--target",
        str(world["target"]),
        "--draft",
        str(draft or world["draft"]),
        "--eval-set",
        str(world["eval_set"]),
        "--hf-eval",
        str(world["hf_eval"]),
        "--out",
        str(out),
        "--settings",
        json.dumps(settings(**overrides)),
    ]


def evaluate(world, tmp_path: Path, draft: Path, settings: dict) -> dict:
    """The stage on the world's files and `draft`, writing tmp_path/out.json."""
    paths = vllm_check.VllmEvalPaths(
        world["target"], draft, world["eval_set"], world["hf_eval"], tmp_path / "out.json"
    )
    return ev.evaluate_vllm(paths, settings)


class FakeEngines:
    """Stands in for the two vLLM processes (no GPU here): records each request and answers
    with given outputs and counters."""

    def __init__(self, outputs: list[list[int]], speculative: list[list[int]] | None = None):
        self.requests: dict[str, dict] = {}
        self.outputs, self.speculative = outputs, speculative or outputs

    def __call__(self, name, request, workers):
        self.requests[name] = request
        spec = request["speculative_config"] is not None
        stats = SpecStats(
            K,
            num_drafts=10,
            num_draft_tokens=30,
            accepted_tokens=12,
            accepted_at_position=[6, 4, 2],
        )
        sampled = request.get("sampled")
        if sampled:  # the sampled run's counters: fewer accepted than greedy's
            drew = SpecStats(K, num_drafts=8, num_draft_tokens=24, accepted_tokens=6)
            drew.accepted_at_position = [4, 2, 0]
            sampled = {**sampled, "counters": drew.metrics()}
        return {
            "vllm_version": "0.22.0",
            "dtype": "bfloat16",
            "outputs": self.speculative if spec else self.outputs,
            "counters": stats.metrics() if spec else None,
            **({"sampled": sampled} if sampled else {}),
        }


# ----------------------------------------------------------------------------- CPU tests


def test_settings_every_problem_at_once():
    bad = settings(
        eval__num_speculative_tokens=0,
        eval__max_new_tokens="8",
        vllm__tensor_parallel_size=0,
        vllm__enforce_eager="yes",
        vllm__max_model_len=-1,
        vllm__gpu_memory_utilization=1.5,
    )
    with pytest.raises(EvaluateError) as err:
        vllm_check.VllmEvalSettings.from_settings(bad)
    msg = str(err.value)
    for key in (
        "eval.num_speculative_tokens: 0 is less than the minimum of 1",
        "eval.max_new_tokens: '8' is not of type 'integer'",
        "vllm.tensor_parallel_size: 0 is less than the minimum of 1",
        "vllm.enforce_eager: 'yes' is not of type 'boolean'",
        "vllm.max_model_len: -1 is not valid under any of the given schemas",
        "vllm.gpu_memory_utilization: 1.5 is greater than the maximum of 1",
    ):
        assert key in msg
    with pytest.raises(EvaluateError, match="eval: missing.*vllm: missing"):
        vllm_check.VllmEvalSettings.from_settings({})
    # the workflow passes gpu_memory_utilization as a flag (it changes no result)
    with pytest.raises(
        EvaluateError, match="--gpu-memory-utilization: 0 is less than or equal to the min"
    ):
        vllm_check.VllmEvalSettings.from_settings(settings(), vllm_runtime(0, EvaluateError))
    cfg = vllm_check.VllmEvalSettings.from_settings(
        {"eval": settings()["eval"], "vllm": {}}, vllm_runtime(0.6)
    )
    assert (cfg.K, cfg.max_new_tokens, cfg.num_prompts) == (K, MAX_NEW, NUM_PROMPTS)
    assert cfg.vllm == VllmSettings.from_section({"gpu_memory_utilization": 0.6})
    assert (cfg.vllm.tensor_parallel_size, cfg.vllm.enforce_eager) == (1, True)
    assert cfg.vllm.max_model_len is None and cfg.rehearsal is False


def test_the_vllm_section_is_typed_from_the_schema():
    """One typed vllm section for every engine: the schema's defaults (stated nowhere else),
    numbers as floats, every problem at once."""
    defaults = validate_config({"target": {"name": "t"}})["vllm"]
    typed = VllmSettings.from_section({})
    assert dataclasses.asdict(typed) == defaults
    assert isinstance(VllmSettings.from_section({"gpu_memory_gib": 80}).gpu_memory_gib, float)
    with pytest.raises(ConfigError) as err:
        VllmSettings.from_section({"tensor_parallel_size": 0, "dtype": "int4", "other": 1})
    for key in ("vllm.tensor_parallel_size: 0", "vllm.dtype: 'int4'", "vllm.other: unknown key"):
        assert key in str(err.value)


@pytest.mark.parametrize("flags", [("fc_norm",), ("norm_output",), ("fc_norm", "norm_output")])
def test_refuses_flags_vllm_ignores_before_any_engine(world, tmp_path, monkeypatch, capsys, flags):
    draft = tmp_path / "draft"
    shutil.copytree(world["draft"], draft)
    config = json.loads((draft / "config.json").read_text())
    config.update({flag: True for flag in flags})
    (draft / "config.json").write_text(json.dumps(config))

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started for a draft that must be refused")

    monkeypatch.setattr(vllm_run, "run_engine", no_engine)
    assert cli.main(stage_args(world, tmp_path / "out.json", draft)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and str(draft / "config.json") in err[0]
    for flag in flags:
        assert f"{flag} is true, but vLLM 0.22 does not read {flag}" in err[0]
        assert f"retrain with {flag} off" in err[0]
    assert not (tmp_path / "out.json").exists()


def test_refuses_draft_of_another_target(world, tmp_path, monkeypatch):
    draft = tmp_path / "draft"
    shutil.copytree(world["draft"], draft)
    config = json.loads((draft / "config.json").read_text())
    config["target_hidden_size"] = 32
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 9]
    (draft / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(vllm_run, "run_engine", None)  # would fail if called
    with pytest.raises(EvaluateError, match=r"target_hidden_size 32 .* 64.*\[1, 2, 9\].*0\.\.3"):
        evaluate(world, tmp_path, draft, settings())


def test_requests_and_report(world, tmp_path, monkeypatch):
    outputs = [[5, 6, 7, world["eos"]], [8] * MAX_NEW, [9, world["eos"]], [10] * MAX_NEW]
    engines = FakeEngines(outputs)
    monkeypatch.setattr(vllm_run, "run_engine", engines)
    stale = vllm_compare.diagnostic_path(tmp_path / "eval_vllm.json")
    stale.write_text("{}")
    out = tmp_path / "eval_vllm.json"
    runtime = json.dumps({"vllm": {"gpu_memory_utilization": 0.4}})
    assert cli.main(stage_args(world, out) + ["--runtime", runtime]) == 0

    base, spec = engines.requests["baseline"], engines.requests["speculative"]
    assert base["speculative_config"] is None
    assert spec["speculative_config"] == {
        "model": str(world["draft"].resolve()),
        "method": "eagle3",
        "num_speculative_tokens": K,
    }
    assert base["engine"] == spec["engine"]  # same execution mode for both runs
    engine = base["engine"]
    assert engine["model"] == str(world["target"].resolve())  # never the verifier path
    assert engine["disable_log_stats"] is False and engine["enforce_eager"] is True
    assert engine["gpu_memory_utilization"] == 0.4
    assert engine["max_model_len"] == max(map(len, world["prompts"])) + MAX_NEW + K
    assert base["prompts"] == world["prompts"] and base["max_new_tokens"] == MAX_NEW
    hf = json.loads(world["hf_eval"].read_text())
    assert base["eos_token_id"] == hf["eos_token_id"] == world["eos"]  # the HF loop's stop token

    report = json.loads(out.read_text())
    assert report["K"] == K and report["vllm_version"] == "0.22.0"
    assert report["outputs_equal"] == report["num_prompts"] == NUM_PROMPTS
    assert report["output_tokens"] == sum(map(len, outputs))
    assert report["acceptance_length"] == pytest.approx(2.2)
    assert report["per_position_acceptance"] == pytest.approx([0.6, 0.4, 0.2])
    assert report["counters"] == {
        "num_drafts": 10,
        "num_draft_tokens": 30,
        "accepted_tokens": 12,
        "accepted_at_position": [6, 4, 2],
    }
    hf_al, hf_pp = hf["trained"]["acceptance_length"], hf["trained"]["per_position_acceptance"]
    assert report["hf"]["acceptance_length"] == hf_al
    assert report["difference"]["acceptance_length"] == pytest.approx(2.2 - hf_al)
    assert report["difference"]["per_position_acceptance"] == pytest.approx(
        [a - b for a, b in zip([0.6, 0.4, 0.2], hf_pp)]
    )
    assert report["engine"]["name"] == "vllm" and report["engine"]["dtype"] == "bfloat16"
    assert report["hf"]["engine"] == {"name": "hf", "dtype": "float32", "device": "cpu"}
    assert report["provenance"]["settings"]["vllm"]["enforce_eager"] is True
    assert not stale.exists()  # a diagnostic from an earlier failed run is removed
    # no temporaries left (.last-good: the report kept for a failed rerun, eyrie.core.io)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != LAST_GOOD]


def test_a_sampled_run_is_reported_beside_the_greedy_one(world, tmp_path, monkeypatch):
    """eval.temperature > 0: the speculative engine is asked to sample every prompt again
    (seeded per prompt) after its greedy run; eval_vllm.json reports that run's AL and
    counters under "sampled", the greedy figures as before; the HF evaluation here did not
    sample, so no HF figure stands beside it. Greedy only: no sampled run, "sampled" null."""
    outputs = [[5, 6, 7, world["eos"]], [8] * MAX_NEW, [9, world["eos"]], [10] * MAX_NEW]
    engines = FakeEngines(outputs)
    monkeypatch.setattr(vllm_run, "run_engine", engines)
    out = tmp_path / "eval_vllm.json"
    assert cli.main(stage_args(world, out, eval__temperature=1.0)) == 0
    base, spec = engines.requests["baseline"], engines.requests["speculative"]
    assert spec["sampled"] == {"temperature": 1.0, "seed": SAMPLE_SEED}
    assert "sampled" not in base
    report = json.loads(out.read_text())
    assert report["acceptance_length"] == pytest.approx(2.2)  # the greedy run, as before
    assert report["sampled"] == {
        "temperature": 1.0,
        "seed": SAMPLE_SEED,
        "acceptance_length": pytest.approx(1 + 6 / 8),
        "per_position_acceptance": pytest.approx([0.5, 0.25, 0.0]),
        "counters": {
            "num_drafts": 8,
            "num_draft_tokens": 24,
            "accepted_tokens": 6,
            "accepted_at_position": [4, 2, 0],
        },
        "hf_acceptance_length": None,
    }
    assert cli.main(stage_args(world, tmp_path / "greedy.json")) == 0
    assert engines.requests["speculative"]["sampled"] is None
    assert json.loads((tmp_path / "greedy.json").read_text())["sampled"] is None


def test_differing_output_fails_with_diagnostic(world, tmp_path, monkeypatch, capsys):
    outputs = [[5, 6, 7], [8, 8, 8], [9, 9], [10]]
    speculative = [[5, 6, 7], [8, 8, 3], [9, 9], [10, 11]]
    monkeypatch.setattr(vllm_run, "run_engine", FakeEngines(outputs, speculative))
    out = tmp_path / "eval_vllm.json"
    assert cli.main(stage_args(world, out)) == 2
    err = capsys.readouterr().err
    assert "2 of 4 speculative outputs differ" in err
    assert "prompt conv.jsonl:2 at new token 2" in err
    assert not out.exists()
    diag = json.loads(vllm_compare.diagnostic_path(out).read_text())
    assert [(p["sample_id"], p["first_difference"]) for p in diag["prompts"]] == [
        ("conv.jsonl:2", 2),
        ("conv.jsonl:4", 1),
    ]
    assert diag["prompts"][0]["baseline"] == [8, 8, 8] and diag["prompts"][0]["speculative"] == [
        8,
        8,
        3,
    ]


def test_stale_hf_evaluation_refused(world, tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_run, "run_engine", None)
    with pytest.raises(EvaluateError, match=r"evaluated with K 3 \(here 2\)"):
        evaluate(world, tmp_path, world["draft"], settings(eval__num_speculative_tokens=2))
    with pytest.raises(EvaluateError, match="vllm.max_model_len=10 is below"):
        evaluate(world, tmp_path, world["draft"], settings(vllm__max_model_len=10))


def test_first_difference():
    assert vllm_compare.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert vllm_compare.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert vllm_compare.first_difference([1, 2], [1, 2, 3]) == 2


def test_workflow_rule_only_when_asked(tmp_path):
    """A dry run plans evaluate_vllm with the vLLM python only when eval.vllm is true."""
    (tmp_path / "convs.jsonl").touch()
    base = {"target": {"name": "tiny"}, "data": {"conversations": ["convs.jsonl"]}}
    plans = {}
    for flag in (False, True):
        (tmp_path / "config.yaml").write_text(
            json.dumps({**base, "eval": {"vllm": flag}, "vllm": {"gpu_memory_utilization": 0.5}})
        )
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "snakemake",
                "-s",
                str(REPO / "Snakefile"),
                "-d",
                str(tmp_path),
                "--configfile",
                str(tmp_path / "config.yaml"),
                "--cores",
                "1",
                "-n",
                "-p",
            ],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        plans[flag] = proc.stdout + proc.stderr
    assert "evaluate_vllm" not in plans[False]
    cmd = next(line for line in plans[True].splitlines() if "evaluate-vllm" in line)
    assert f"{REPO / '.venv-vllm/bin/python'} -m eyrie.cli evaluate-vllm" in cmd
    runtime = '--runtime \'{"vllm":{"gpu_memory_utilization":0.5}}\''
    assert runtime in cmd and "--hf-eval results/tiny/eval/eval.json" in cmd
    # only what changes the result is compared by the params trigger
    passed = json.loads(cmd.split("--settings '", 1)[1].split("'", 1)[0])
    assert passed == {
        "eval": {"max_new_tokens": 64, "num_prompts": 16, "num_speculative_tokens": 3},
        "vllm": {
            "dtype": "auto",
            "enforce_eager": True,
            "max_model_len": None,
            "tensor_parallel_size": 1,
        },
    }


# ----------------------------------------------------------------------------- vLLM environment

needs_vllm_env = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM environment at {VLLM_PYTHON}: run `bash scripts/setup-vllm.sh` "
    "(or set EYRIE_VLLM_PYTHON)",
)


def vllm_python(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, cwd=REPO, timeout=timeout
    )


@pytest.mark.slow
@needs_vllm_env
@pytest.mark.vllm_env
@pytest.mark.parametrize("arch,ok", [("LlamaForCausalLM", True), ("GPT2LMHeadModel", False)])
def test_installed_vllm_check_in_the_vllm_environment(tmp_path, arch, ok):
    """The first seconds of evaluate-vllm: the real installed vLLM's version and whether the
    target's class can serve an EAGLE-3 draft (GPT-2 cannot)."""
    model_type = "llama" if arch.startswith("Llama") else "gpt2"
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": [arch], "model_type": model_type})
    )
    proc = vllm_python(
        "import sys; from eyrie.evaluate.vllm_check import check_installed_vllm; "
        f"check_installed_vllm({str(tmp_path)!r}, {str(tmp_path)!r}, "
        "{'speculators_model_type': 'eagle3'}); print('ok')",
        timeout=180,
    )
    if ok:
        assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
    else:
        assert proc.returncode != 0
        assert "has no vLLM adapter" in proc.stderr or "cannot be an EAGLE-3 target" in proc.stderr


@pytest.mark.slow
@needs_vllm_env
@pytest.mark.vllm_env
def test_installed_vllm_check_of_block_drafters_in_the_vllm_environment(tmp_path):
    """A block drafter in the evaluation's first seconds, against the default environment's
    vLLM (0.22: DFlash only, its converter not reading sample_from_anchor; docs/vllm.md's
    block_drafts): a DFlash draft as speculators defaults it passes; a DSpark draft, and a DFlash
    draft that samples from its anchor, are each one line naming the draft's config.json."""
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    cases = {
        "dflash": ({"sample_from_anchor": False}, None),
        "dspark": ({"sample_from_anchor": False}, "serves no dspark draft"),
        "dflash-anchor": ({"sample_from_anchor": True}, "does not read it"),
    }
    drafts = {
        name: {"speculators_model_type": name.split("-")[0], "block_size": 8, **fields}
        for name, (fields, _) in cases.items()
    }
    proc = vllm_python(  # one process: the facts are gathered once
        "import json\n"
        "from eyrie.core.errors import EvaluateError\n"
        "from eyrie.evaluate.vllm_check import check_installed_vllm\n"
        "out = {}\n"
        f"for name, draft in {drafts!r}.items():\n"
        "    try:\n"
        f"        check_installed_vllm({str(tmp_path)!r}, 'runs/draft', draft)\n"
        "        out[name] = None\n"
        "    except EvaluateError as exc:\n"
        "        out[name] = str(exc)\n"
        "print(json.dumps(out))\n",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (_, refused) in cases.items():
        if refused is None:
            assert got[name] is None, name
        else:
            assert refused in got[name] and "runs/draft/config.json" in got[name], got[name]


@pytest.mark.slow
@needs_vllm_env
def test_module_imports_in_vllm_environment():
    proc = vllm_python(
        "import sys, eyrie.evaluate.vllm_eval, eyrie.cli; "
        "print(sorted(m for m in sys.modules "
        "if m in ('speculators', 'matplotlib') or m.startswith('eyrie.train')))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


COUNTERS_SCRIPT = r"""
import json
from vllm.v1.metrics.reader import Counter, Gauge, Vector
from eyrie.evaluate.vllm_run import counter_growth, counter_totals, stats_of

def spec_counters(metrics, K):  # what generate() reports of a run's counters
    return stats_of(K, counter_totals(metrics, K)).metrics()
from eyrie.config.schema import validate_config
from eyrie.config.sections import VllmSettings
from eyrie.core.errors import ConfigError, EvaluateError

def engine(idx, drafts, draft_tokens, accepted, per_pos):
    labels = {"model_name": "t", "engine": str(idx)}
    return [Counter("vllm:spec_decode_num_drafts", labels, drafts),
            Counter("vllm:spec_decode_num_draft_tokens", labels, draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", labels, accepted),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, per_pos)]

noise = [Counter("vllm:prompt_tokens", {}, 99), Gauge("vllm:num_requests_running", {}, 1.0)]
out = {}
out["one"] = spec_counters(noise + engine(0, 10, 30, 12, [6, 4, 2]), 3)
two = engine(0, 10, 30, 12, [6, 4, 2]) + engine(1, 6, 18, 3, [2, 1, 0])
out["two_engines"] = spec_counters(two, 3)
out["no_drafts"] = spec_counters(engine(0, 0, 0, 0, [0, 0, 0]), 3)
# a sampled run after the greedy one: the counters' growth (eyrie.evaluate.vllm_run.sample_again)
before = counter_totals(engine(0, 10, 30, 12, [6, 4, 2]), 3)
after = counter_totals(engine(0, 18, 54, 18, [10, 6, 2]), 3)
out["grown"] = stats_of(3, counter_growth(after, before)).metrics()
class Lookalike:  # not vLLM's class: must not be read
    def __init__(self, name, value): self.name, self.value = name, value
cases = {
    "missing": noise + [Lookalike("vllm:spec_decode_num_drafts", 10)],
    "wrong_k": engine(0, 10, 30, 12, [6, 4]),
    "inconsistent": engine(0, 10, 30, 12, [6, 4, 1]),
}
for name, metrics in cases.items():
    try:
        spec_counters(metrics, 3)
        out[name] = None
    except EvaluateError as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""


@pytest.mark.slow
@needs_vllm_env
def test_counters_to_acceptance_on_vllm_metric_classes():
    proc = vllm_python(COUNTERS_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    one = out["one"]
    assert one["acceptance_length"] == pytest.approx(1 + 12 / 10)
    assert one["per_position_acceptance"] == pytest.approx([0.6, 0.4, 0.2])
    assert (one["num_drafts"], one["num_draft_tokens"], one["accepted_tokens"]) == (10, 30, 12)
    two = out["two_engines"]  # summed over engines, then divided
    assert two["acceptance_length"] == pytest.approx(1 + 15 / 16)
    assert two["per_position_acceptance"] == pytest.approx([8 / 16, 5 / 16, 2 / 16])
    assert two["accepted_at_position"] == [8, 5, 2]
    grown = out["grown"]  # 8 drafts, 6 accepted (4, 2, 0) since the greedy run's totals
    assert grown["acceptance_length"] == pytest.approx(1 + 6 / 8)
    assert grown["accepted_at_position"] == [4, 2, 0] and grown["num_draft_tokens"] == 24
    assert out["no_drafts"]["acceptance_length"] is None
    assert out["no_drafts"]["per_position_acceptance"] is None
    assert (
        "vllm:spec_decode_num_accepted_tokens" in out["missing"]
        and "disable_log_stats" in out["missing"]
    )
    assert "2 positions, expected K=3" in out["wrong_k"]
    assert "sums to 11" in out["inconsistent"]


# ----------------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def vllm_cuda():
    """Skips (before the world is built) unless the vLLM python sees a CUDA device."""
    cuda = vllm_python("import torch; print(torch.cuda.is_available())")
    if cuda.stdout.strip() != "True":
        pytest.skip(f"{VLLM_PYTHON} sees no CUDA device")


@pytest.mark.gpu
@needs_vllm_env
def test_whole_stage_through_vllm(vllm_cuda, world, tmp_path):
    """The stage on a GPU: vLLM serves the tiny target with the exported draft; speculative and
    baseline outputs agree token for token and the counters give the report's AL; at
    eval.temperature 1 the same engine then samples every prompt, its counters' growth the
    sampled AL."""
    out = tmp_path / "eval_vllm.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-m", "eyrie.cli", *stage_args(world, out, eval__temperature=1.0)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["vllm_version"] and report["K"] == K
    assert report["outputs_equal"] == report["num_prompts"] == NUM_PROMPTS
    c = report["counters"]
    # vLLM drafts fewer than K tokens when a request is near max_tokens
    assert c["num_drafts"] > 0 and 0 < c["num_draft_tokens"] <= K * c["num_drafts"]
    assert sum(c["accepted_at_position"]) == c["accepted_tokens"]
    assert report["acceptance_length"] == pytest.approx(1 + c["accepted_tokens"] / c["num_drafts"])
    assert report["per_position_acceptance"] == pytest.approx(
        [a / c["num_drafts"] for a in c["accepted_at_position"]]
    )
    assert 0 < report["output_tokens"] <= NUM_PROMPTS * MAX_NEW
    drew = report["sampled"]["counters"]
    assert report["sampled"]["temperature"] == 1.0 and drew["num_drafts"] > 0
    assert sum(drew["accepted_at_position"]) == drew["accepted_tokens"]
    assert report["sampled"]["acceptance_length"] == pytest.approx(
        1 + drew["accepted_tokens"] / drew["num_drafts"]
    )
    hf = json.loads(world["hf_eval"].read_text())
    assert report["hf"]["acceptance_length"] == hf["trained"]["acceptance_length"]
    assert report["difference"]["acceptance_length"] == pytest.approx(
        report["acceptance_length"] - hf["trained"]["acceptance_length"]
    )
    assert not vllm_compare.diagnostic_path(out).exists()


@pytest.mark.gpu
@needs_vllm_env
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_block_draft_through_vllm(vllm_cuda, world, tmp_path, method):
    """A block drafter (blocks of K + 1, the anchor the bonus token: what every vLLM with the
    method serves as trained) through the stage on a GPU: served by the installed vLLM with its
    method (DSpark on vLLM's V2 runner, which vLLM picks for it), outputs equal to the baseline's
    and the counters' AL; on a vLLM without the method, one line naming the draft's config."""
    root = tmp_path / "block"
    (root / "train").mkdir(parents=True)
    block = dict(method=method, block_size=K + 1, sample_from_anchor=False)
    _, d2t, t2d = write_vocab(root, build_chat_tokenizer(TEXTS, vocab_size=300))
    draft = write_draft(root, world["target"], d2t, t2d, **block)
    files = {**{k: world[k] for k in ("target", "eval_set")}, "draft": draft}
    files |= {"vocab": root / "vocab.safetensors", "preflight": world["root"] / "preflight.json"}
    hf_eval = hf_evaluate(root, files)
    out = tmp_path / "eval_vllm.json"
    argv = stage_args({**world, "hf_eval": hf_eval}, out, draft)
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-m", "eyrie.cli", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=900,
    )
    version = vllm_python("import vllm; print(vllm.__version__)").stdout.strip()
    if method == "dspark" and version.startswith("0.22."):
        assert proc.returncode != 0 and "serves no dspark draft" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["K"] == K and report["outputs_equal"] == report["num_prompts"] == NUM_PROMPTS
    c = report["counters"]
    assert c["num_drafts"] > 0 and sum(c["accepted_at_position"]) == c["accepted_tokens"]
    assert report["acceptance_length"] == pytest.approx(1 + c["accepted_tokens"] / c["num_drafts"])

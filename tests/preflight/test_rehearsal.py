"""The rehearsal (vllm.rehearsal: true, docs/rehearsal.md): the switch reaches every vLLM engine's
arguments (and each installed vLLM reads them as random target weights and the draft's own), a
rehearsal's files are marked, real stages refuse them in one line while a rehearsal takes them,
and its DAG lives under results/<name>.rehearsal/. Marked gpu: the extraction on real widths
(tests/support/vllm_gpu_check.py rehearsal) and the whole tiny DAG as a rehearsal."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import h5py
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from eyrie import cli
from eyrie.config.schema import cross_field_problems, validate_config
from eyrie.config.sections import ExtractSettings, VllmSettings
from eyrie.core.errors import ExportError, ExtractError, PreflightError, ShardError
from eyrie.core.rehearsal import draft_is_rehearsal, engine_kwargs
from eyrie.evaluate import vllm_check as ev
from eyrie.evaluate import vllm_eval, vllm_run
from eyrie.export.export import export
from eyrie.extract import extractor as extractor_mod
from eyrie.extract.batches import HostBatch
from eyrie.extract.extract import store_key
from eyrie.extract.extractor import Extractor
from eyrie.extract.vllm_backend import VllmBackend
from eyrie.formats.hidden import ShardMeta, ShardReader, read_meta
from eyrie.formats.report import identity
from eyrie.preflight import preflight as pf
from eyrie.preflight import vllm_checks as vp
from eyrie.train.inputs import check_rehearsal
from eyrie.vllm.engine import bounds
from tests.support import REPO
from tests.support.stages import demo_conversations
from tests.support.train_helpers import (
    save_chat_target,
    train_args,
    train_settings,
    write_eval_set,
    write_shard,
)
from tests.support.vllm_helpers import (
    VLLM_ENVS,
    need_cuda,
    need_vllm,
    real_facts,
    vllm_env,
    vllm_settings,
)
from tests.support.workflow import TINY, job_table, run_snakemake

VLLM_PYTHON = Path(os.environ.get("EYRIE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
REHEARSE = {"vllm": {"rehearsal": True}}
K = 3


def rehearsal_settings(settings: dict) -> dict:
    return {**settings, **REHEARSE}


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]


# ----------------------------------------------------------------------------- the engines


@pytest.mark.parametrize("path", ["native", "capture"])
def test_switch_reaches_the_extraction_engine(tmp_path, path):
    """VllmBackend's vllm.LLM arguments: load_format dummy with the switch, nothing without; the
    lengths preflight chose (preflight.json's vllm.engine.extraction) in both."""
    (tmp_path / "config.json").write_text("{}")
    cfg = SimpleNamespace(dtype=torch.bfloat16, trust_remote_code=False)
    kwargs = {}
    for rehearsal in (False, True):
        backend = object.__new__(VllmBackend)  # its constructor starts vLLM; the kwargs need none
        backend.vllm = VllmSettings.from_section(dict(tensor_parallel_size=2, rehearsal=rehearsal))
        backend.path, backend.layer_ids, backend.scratch = path, [1, 2, 3, 4], tmp_path
        engine = bounds(backend.vllm, 902, chunked=False, source="the longest tokenized sample")
        kwargs[rehearsal] = backend._engine_kwargs(tmp_path, cfg, engine)
    assert "load_format" not in kwargs[False]
    assert kwargs[True] == {**kwargs[False], "load_format": "dummy"}
    lengths = {k: kwargs[False][k] for k in ("max_model_len", "max_num_batched_tokens")}
    assert lengths == {"max_model_len": 902, "max_num_batched_tokens": 16384}
    assert kwargs[False]["max_num_seqs"] == 256 and not kwargs[False]["enable_chunked_prefill"]


@pytest.mark.slow
@pytest.mark.vllm_env
@pytest.mark.parametrize("version", sorted(VLLM_ENVS))
def test_every_installed_vllm_reads_the_switch_as_random_weights(version):
    """What the engines pass, read by each installed vLLM's own config classes and loader
    registry: the target's load_format picks the dummy loader, the speculative run's
    draft_load_config the default loader (the draft's real weights)."""
    probe = (
        "import dataclasses, json\n"
        "from pydantic import TypeAdapter\n"
        "from vllm.config import LoadConfig, SpeculativeConfig\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.model_executor.model_loader import get_model_loader\n"
        "from eyrie.core.rehearsal import DRAFT_LOAD_CONFIG, engine_kwargs\n"
        "args = EngineArgs(model='target', **engine_kwargs(True))\n"
        "field = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}['draft_load_config']\n"
        "draft = TypeAdapter(field.type).validate_python(DRAFT_LOAD_CONFIG)\n"
        "print(json.dumps([type(get_model_loader(LoadConfig(load_format=args.load_format)))"
        ".__name__, type(get_model_loader(draft)).__name__]))\n"
    )
    proc = subprocess.run(
        [str(vllm_env(version)), "-c", probe],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == ["DummyModelLoader", "DefaultModelLoader"]


# ----------------------------------------------------------------------------- the world


@pytest.fixture(scope="module")
def world(world):
    """The tiny world (tests/conftest.py: target, vocabulary, preflight report and two real
    shards), plus the same states written as a rehearsal's shard and an eval set of the samples'
    prompts."""
    w, root = dict(world), world["target"].parent
    rehearsal = root / "rehearsal_000.h5"
    part = w["samples"][0::2]
    ids = [f"conv.jsonl:{1 + 2 * i}" for i in range(len(part))]
    write_shard(rehearsal, w["model"], part, ShardMeta(**w["meta"], rehearsal=True), ids)
    prompts = [sample[: mask.index(1)] for sample, mask in w["samples"][:4]]
    w["rehearsal_shard"] = rehearsal
    w["eval_set"] = write_eval_set(root / "eval.parquet", prompts)
    w["root"] = root
    return w


def train_argv(world, shards: list[Path], out: Path, settings: dict) -> list[str]:
    return train_args(world, out, settings, shards, state="train_state")


def test_shards_marked_only_in_a_rehearsal(world, tmp_path):
    """The attribute `rehearsal` = 1 on a rehearsal's shard, absent on a real one (whose bytes
    stay as before); a reader refuses any other value."""
    with h5py.File(world["rehearsal_shard"], "r") as f:
        assert int(f.attrs["rehearsal"]) == 1
    with h5py.File(world["shards"][0], "r") as f:
        assert "rehearsal" not in f.attrs
    assert read_meta(world["rehearsal_shard"]).rehearsal is True
    assert ShardReader(world["shards"][0]).meta.rehearsal is False
    odd = tmp_path / "odd.h5"
    odd.write_bytes(world["rehearsal_shard"].read_bytes())
    with h5py.File(odd, "a") as f:
        f.attrs["rehearsal"] = 2
    with pytest.raises(ShardError, match=r"odd\.h5: attr 'rehearsal' is 2, not 1"):
        read_meta(odd)


def test_real_training_refuses_a_rehearsal_shard_in_one_line(world, tmp_path, capsys):
    shards = [world["shards"][0], world["rehearsal_shard"]]
    argv = train_argv(world, shards, tmp_path, train_settings(epochs=1))
    assert cli.main(argv) == 2
    assert error_lines(capsys) == [
        f"eyrie train: error: {world['rehearsal_shard']}: a hidden-state shard of a rehearsal "
        "(vllm.rehearsal: true: the target ran with random weights), which a real run never "
        "uses; train on the shards of the run without vllm.rehearsal (results/<name>/hidden/), "
        "or set vllm.rehearsal: true to rehearse the training (docs/rehearsal.md)"
    ]
    assert not (tmp_path / "train").exists() and not (tmp_path / "train_state").exists()
    with pytest.raises(ShardError, match=r"rehearsal_000\.h5 \(and 1 more of the 2 shards\)"):
        check_rehearsal([world["rehearsal_shard"], world["rehearsal_shard"]], rehearsal=False)
    check_rehearsal(world["shards"], rehearsal=False)  # real shards: nothing to refuse


@pytest.fixture(scope="module")
def rehearsed(world, tmp_path_factory):
    """A rehearsal's training on its shard (the CLI, as the workflow runs it) and its export."""
    out = tmp_path_factory.mktemp("rehearsed")
    settings = rehearsal_settings(train_settings(epochs=1, ttt_steps=K))
    assert cli.main(train_argv(world, [world["rehearsal_shard"]], out, settings)) == 0
    draft = out / "draft"
    done = export(world["target"], out / "train", draft, settings, manifest=out / "draft.json")
    return {"out": out, "draft": draft, "settings": settings, "manifest": done}


def test_a_rehearsal_trains_on_its_shard_and_marks_what_it_writes(rehearsed):
    out = rehearsed["out"]
    summary = json.loads((out / "train" / "train.json").read_text())
    assert summary["rehearsal"] is True and summary["steps"] > 0
    provenance = json.loads((rehearsed["draft"] / "provenance.json").read_text())
    assert provenance["rehearsal"] is True
    assert json.loads((out / "draft.json").read_text())["rehearsal"] is True
    assert draft_is_rehearsal(rehearsed["draft"])


def test_real_export_refuses_a_rehearsal_training(world, rehearsed, tmp_path):
    train_dir = rehearsed["out"] / "train"
    with pytest.raises(ExportError) as err:
        export(world["target"], train_dir, tmp_path / "draft", train_settings(ttt_steps=K))
    assert str(err.value) == (
        f"{train_dir / 'train.json'}: a training of a rehearsal (vllm.rehearsal: true: the "
        "target ran with random weights), which a real run never uses; export the training of "
        "the run without vllm.rehearsal (results/<name>/train), or set vllm.rehearsal: true to "
        "rehearse the export (docs/rehearsal.md)"
    )
    assert not (tmp_path / "draft").exists() and not (tmp_path / "drafts").exists()


def test_hugging_face_evaluation_refuses_a_rehearsal_draft(world, rehearsed, tmp_path, capsys):
    argv = ["evaluate", "--target", str(world["target"]), "--draft", str(rehearsed["draft"])]
    argv += ["--vocab", str(world["vocab"]), "--eval-set", str(world["eval_set"])]
    argv += ["--preflight", str(world["preflight"]), "--out", str(tmp_path / "eval.json")]
    argv += ["--plot", str(tmp_path / "eval.png")]
    settings = {"eval": {"num_speculative_tokens": K, "max_new_tokens": 4, "num_prompts": 2}}
    assert cli.main([*argv, "--settings", json.dumps(settings)]) == 2
    assert error_lines(capsys) == [
        f"eyrie evaluate: error: {rehearsed['draft'] / 'provenance.json'}: a draft of a "
        "rehearsal (vllm.rehearsal: true: the target ran with random weights), which a real run "
        "never uses; evaluate the draft of the run without vllm.rehearsal (results/<name>/draft); "
        "a rehearsal has no Hugging Face evaluation (docs/rehearsal.md)"
    ]
    assert not (tmp_path / "eval.json").exists()


class FakeEngines:
    """Stands in for evaluate-vllm's two engine processes (no GPU here): records each request,
    answers with `outputs` (baseline) and `speculative`, and counters."""

    def __init__(self, outputs: list[list[int]], speculative: list[list[int]]):
        self.requests: dict[str, dict] = {}
        self.outputs, self.speculative = outputs, speculative

    def __call__(self, name, request, workers):
        self.requests[name] = request
        spec = request["speculative_config"] is not None
        counters = vllm_run.SpecStats(K, 4, 12, 3, [2, 1, 0]).metrics() if spec else None
        return {
            "vllm_version": "0.22.0",
            "dtype": "bfloat16",
            "outputs": self.speculative if spec else self.outputs,
            "counters": counters,
        }


def vllm_eval_settings(rehearsal: bool) -> dict:
    vllm = {"tensor_parallel_size": 1, "enforce_eager": True, "max_model_len": None}
    return {
        "eval": {"num_speculative_tokens": K, "max_new_tokens": 4, "num_prompts": 2},
        "vllm": {**vllm, "rehearsal": True} if rehearsal else vllm,
    }


def test_vllm_evaluation_of_a_rehearsal(world, rehearsed, tmp_path, monkeypatch, capsys):
    """A real evaluation refuses the rehearsal's draft before any engine; a rehearsal runs both
    engines on random target weights with the draft's own, without the HF evaluation, and counts
    differing outputs (near-ties of random weights) instead of failing on them."""
    monkeypatch.setattr(ev, "check_installed_vllm", lambda *args: None)  # vLLM is not here
    engines = FakeEngines([[5, 6, 7, 8], [9, 9, 9, 9]], [[5, 6, 7, 8], [9, 9, 3, 9]])
    monkeypatch.setattr(vllm_run, "run_engine", engines)
    monkeypatch.setattr(vllm_eval, "EngineWorkers", contextlib.nullcontext)  # no processes here
    out = tmp_path / "eval_vllm.json"
    argv = ["evaluate-vllm", "--target", str(world["target"]), "--draft", str(rehearsed["draft"])]
    argv += ["--eval-set", str(world["eval_set"]), "--out", str(out)]
    real = [*argv, "--hf-eval", str(tmp_path / "eval.json")]
    assert cli.main([*real, "--settings", json.dumps(vllm_eval_settings(False))]) == 2
    assert error_lines(capsys) == [
        f"eyrie evaluate-vllm: error: {rehearsed['draft'] / 'provenance.json'}: a draft of a "
        "rehearsal (vllm.rehearsal: true: the target ran with random weights), which a real run "
        "never uses; evaluate the draft of the run without vllm.rehearsal (results/<name>/draft), "
        "or set vllm.rehearsal: true to rehearse the evaluation (docs/rehearsal.md)"
    ]
    assert cli.main([*argv, "--settings", json.dumps(vllm_eval_settings(False))]) == 2
    assert "--hf-eval: missing" in error_lines(capsys)[0]
    assert engines.requests == {}  # refused before any engine

    assert cli.main([*argv, "--settings", json.dumps(vllm_eval_settings(True))]) == 0
    base, spec = engines.requests["baseline"], engines.requests["speculative"]
    assert base["engine"] == spec["engine"] and base["engine"]["load_format"] == "dummy"
    assert spec["speculative_config"] == {
        "model": str(rehearsed["draft"].resolve()),
        "method": "eagle3",
        "num_speculative_tokens": K,
        "draft_load_config": {"load_format": "auto"},
    }
    assert base["eos_token_id"] is None  # no HF evaluation: every prompt decodes max_new_tokens
    report = json.loads(out.read_text())
    assert report["rehearsal"] is True and report["hf"] is None and report["difference"] is None
    assert report["outputs_equal"] == 1 and report["num_prompts"] == 2
    assert report["acceptance_length"] == pytest.approx(1 + 3 / 4)


def test_real_vllm_evaluation_requests_are_unchanged(world, tmp_path):
    """Without the switch the engine has no load_format and the draft no load config."""
    cfg = ev.VllmEvalSettings.from_settings(vllm_eval_settings(False))
    assert cfg.rehearsal is False
    paths = ev.VllmEvalPaths(world["target"], tmp_path, world["eval_set"], None, tmp_path / "o")
    eagle3 = {"speculators_model_type": "eagle3"}  # the exported draft's config (its method)
    plan = ev.VllmPlan(paths, cfg, {}, eagle3, {"eos_token_id": 2}, [("a", [1, 2])], 16)
    base, spec = vllm_run.engine_requests(plan)
    assert "load_format" not in base["engine"] and base["eos_token_id"] == 2
    assert set(spec["speculative_config"]) == {"model", "method", "num_speculative_tokens"}
    assert engine_kwargs(False) == {}


# ----------------------------------------------------------------------------- extraction


def write_tokenized(path: Path, samples) -> Path:
    pq.write_table(
        pa.table(
            {
                "sample_id": [f"conv.jsonl:{i + 1}" for i in range(len(samples))],
                "input_ids": pa.array([s[0] for s in samples], type=pa.list_(pa.int32())),
                "loss_mask": pa.array([s[1] for s in samples], type=pa.list_(pa.uint8())),
            }
        ),
        path,
    )
    return path


class FakeVllmBackend:
    """The vllm backend's place in the extractor (its engine needs a GPU): random host states."""

    def __init__(self, target, info, cfg, aux_ids, final_id, engine=None):
        self.H, self.n_aux = info.hidden_size, len(aux_ids)
        self.engine = engine  # preflight.json's vllm.engine.extraction, as the real one takes

    def states(self, input_ids, storage):
        g = torch.Generator().manual_seed(0)
        aux = [torch.randn(len(x), self.n_aux * self.H, generator=g) for x in input_ids]
        final = [torch.randn(len(x), self.H, generator=g) for x in input_ids]
        yield HostBatch(list(range(len(input_ids))), aux, final)

    def close(self):
        pass


def extract_settings(backend: str, rehearsal: bool) -> dict:
    settings = {
        "extract": {"backend": backend, "device": "cpu", "max_tokens_per_batch": 512},
        "layers": {"aux_ids": [1, 2, 3]},
        "trust_remote_code": False,
        "vllm": {"extraction_path": "auto"},
    }
    if rehearsal:
        settings["vllm"]["rehearsal"] = True
    return settings


def test_extraction_marks_a_rehearsal_shard_and_keys_it_apart(world, tmp_path, monkeypatch):
    monkeypatch.setattr(extractor_mod, "backend_class", lambda name: FakeVllmBackend)
    shard = write_tokenized(tmp_path / "shard_000.parquet", world["samples"][:6])
    marks = {}
    for rehearsal in (False, True):
        out = tmp_path / f"{rehearsal}.h5"
        settings = extract_settings("vllm", rehearsal)
        with Extractor(world["target"], world["preflight"], settings) as extractor:
            extractor.extract(shard, out)
        with h5py.File(out, "r") as f:
            marks[rehearsal] = f.attrs.get("rehearsal")
    assert marks == {False: None, True: 1}
    # the output store keeps the two apart: the settings are in the key
    keys = {
        r: store_key(str(shard), str(world["preflight"]), extract_settings("vllm", r))[0]
        for r in (False, True)
    }
    assert keys[False] != keys[True]


def test_hugging_face_extraction_refuses_the_switch():
    """The stage refuses it in the words of the dry run (one rule: cross_field_problems)."""
    with pytest.raises(ExtractError) as err:
        ExtractSettings.from_settings(extract_settings("hf", True))
    assert str(err.value) == (
        "invalid --settings: vllm.rehearsal: true but extract.backend is 'hf': a rehearsal runs "
        "the vLLM engines on random weights, and the hf backend would load the real ones; set "
        "extract.backend: vllm (docs/rehearsal.md)"
    )


# ----------------------------------------------------------------------------- preflight


@pytest.mark.slow
@need_vllm
def test_preflight_checks_a_rehearsal_as_a_real_run_and_marks_it(tmp_path, monkeypatch):
    """The same checks and the same report, plus the mark (which keeps the report's identity,
    hence the store keys and the training run id, apart from the real run's)."""
    facts = real_facts()["llama"]
    monkeypatch.setattr(vp, "installed_facts", lambda check: facts)
    texts = ["What does json.dumps do? It serializes an object to a JSON string."] * 20
    target = save_chat_target(
        tmp_path / "target", texts, num_attention_heads=4, num_key_value_heads=2
    )
    rehearsal = vllm_settings(rehearsal=True)  # eval.vllm false: a rehearsal evaluates anyway
    real = vllm_settings()
    real["eval"]["vllm"] = True
    got = {False: pf.preflight(target, None, tmp_path, real)}
    got[True] = pf.preflight(target, None, tmp_path, rehearsal)
    assert got[True]["rehearsal"] is True and "rehearsal" not in got[False]
    assert identity(got[True]) != identity(got[False])
    assert got[False]["vllm"]["used_for"] == ["extract", "eval"]
    for report in got.values():
        report.pop("provenance")
    got[True].pop("rehearsal")
    assert got[True] == got[False]


@pytest.mark.slow
@need_vllm
def test_a_rehearsal_needs_no_weights(world, tmp_path, monkeypatch):
    """From a folder with config.json and the tokenizer only (the weights still downloading):
    preflight says it did not check weights and sizes them from the architecture, training takes
    random embedding and lm_head rows of the target's shapes; a real run stops in preflight."""
    import shutil

    monkeypatch.setattr(vp, "installed_facts", lambda check: real_facts()["llama"])
    bare = tmp_path / "bare"
    shutil.copytree(world["target"], bare, ignore=shutil.ignore_patterns("*.safetensors"))
    layers = {"layers": {"aux_ids": [1, 2, 3]}}  # the tiny target has 4 layers
    report = pf.preflight(bare, None, tmp_path, {**vllm_settings(rehearsal=True), **layers})
    assert (
        report["weights"]["checked"] is False
        and "a rehearsal does not read" in (report["weights"]["note"])
    )
    memory = report["vllm"]["memory"]
    assert "the architecture in config.json" in memory["source"] and memory["bytes"] > 0
    with pytest.raises(PreflightError, match="no \\*.safetensors weights found"):
        pf.preflight(bare, None, tmp_path, {**vllm_settings(), **layers})
    out = tmp_path / "train"
    settings = rehearsal_settings(train_settings(epochs=1, ttt_steps=K))
    argv = train_argv(world, [world["rehearsal_shard"]], out, settings)
    argv[argv.index(str(world["target"]))] = str(bare)
    assert cli.main(argv) == 0
    assert json.loads((out / "train" / "train.json").read_text())["rehearsal"] is True


# ----------------------------------------------------------------------------- the config


def test_parse_time_problems_one_line_each():
    config = validate_config({"target": {"name": "t"}, "extract": {"backend": "vllm"}})
    assert cross_field_problems(config) == []
    assert cross_field_problems({**config, **REHEARSE}) == []
    hf = {**config, **REHEARSE, "extract": {**config["extract"], "backend": "hf"}}
    assert cross_field_problems(hf) == [
        "vllm.rehearsal: true but extract.backend is 'hf': a rehearsal runs the vLLM engines on "
        "random weights, and the hf backend would load the real ones; set extract.backend: vllm "
        "(docs/rehearsal.md)"
    ]
    regen = {**config, **REHEARSE, "data": {**config["data"], "regenerate": True}}
    assert cross_field_problems(regen) == [
        "vllm.rehearsal: true with data.regenerate: true: a random-weight target's responses run "
        "to regenerate.max_new_tokens, so every record would be dropped as cut; set "
        "data.regenerate: false for the rehearsal (docs/rehearsal.md)"
    ]
    named = {**config, "target": {**config["target"], "name": "t.rehearsal"}}
    assert cross_field_problems(named) == [
        "target.name: 't.rehearsal' ends in '.rehearsal', which names a rehearsal's folders; "
        "choose a name without it (docs/rehearsal.md)"
    ]


# ----------------------------------------------------------------------------- the workflow


def dry_run(workdir: Path, *configfiles: Path, ok: bool = True) -> str:
    proc = run_snakemake(workdir, "--cores", "1", "-n", "-p", configfiles=configfiles, timeout=300)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, out[-6000:]
    return out


def shell(out: str, rule: str) -> str:
    block = out.split(f"rule {rule}:", 1)[1]
    return block.split("Shell command: ", 1)[1].splitlines()[0]


def passed_settings(command: str) -> dict:
    return json.loads(command.split("--settings '", 1)[1].split("'", 1)[0])


def write_tiny(workdir: Path, **sections) -> Path:
    config = json.loads(json.dumps(TINY))
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    (workdir / "convs.jsonl").touch()
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_rehearsal_dag_lives_apart(tmp_path):
    """The tiny config with the overlay config/rehearsal.yaml: everything under
    results/tiny.rehearsal/ (and logs/, resources/), shard 000 alone, training on it, export and
    the vLLM evaluation without the HF one; the switch in the settings of every stage it changes.
    Without the overlay the same config plans the real run, with no trace of the switch."""
    config = write_tiny(tmp_path, extract={"backend": "vllm"})
    out = dry_run(tmp_path, config, REPO / "config" / "rehearsal.yaml")
    assert job_table(out) == {
        "build_demo_conversations": 1,
        "build_demo_target": 1,
        "tokenize_conversations": 1,
        "build_vocab_map": 1,
        "preflight": 1,
        "compile_kernels": 1,
        "extract_engine": 1,
        "extract_hidden_states": 1,
        "train_draft": 1,
        "export_draft": 1,
        "evaluate_vllm": 1,
        "all": 1,
    }
    paths = re.findall(r"(?:results|logs|resources)/[\w.-]+/", out)
    assert paths and set(paths) <= {
        "results/tiny.rehearsal/",
        "logs/tiny.rehearsal/",
        "resources/tiny.rehearsal/",
    }
    assert "extract_hidden_states/shard_000" in out and "shard_001.h5" not in out
    train = shell(out, "train_draft")
    assert " --shards results/tiny.rehearsal/hidden/shard_000.h5 --out-dir" in train
    evaluate = shell(out, "evaluate_vllm")
    assert "--hf-eval" not in evaluate
    for rule in ("preflight", "extract_hidden_states", "train_draft", "export_draft"):
        assert passed_settings(shell(out, rule))["vllm"]["rehearsal"] is True, rule
    assert passed_settings(evaluate)["vllm"]["rehearsal"] is True

    real = dry_run(tmp_path, config)
    assert "results/tiny.rehearsal" not in real and "results/tiny/eval/eval.json" in real
    assert "evaluate_draft" in job_table(real) and "evaluate_vllm" not in job_table(real)
    assert " --shards results/tiny/hidden/shard_000.h5 results/tiny/hidden/shard_001.h5" in real
    for rule in ("preflight", "extract_hidden_states", "train_draft", "export_draft"):
        assert "rehearsal" not in shell(real, rule), rule


def test_config_problems_stop_the_parse_in_one_line(tmp_path):
    config = write_tiny(tmp_path, vllm={"rehearsal": True})
    out = dry_run(tmp_path, config, ok=False)
    lines = [line for line in out.splitlines() if line.startswith("eyrie config: error:")]
    assert lines == [
        f"eyrie config: error: {config}: vllm.rehearsal: true but extract.backend is 'hf': a "
        "rehearsal runs the vLLM engines on random weights, and the hf backend would load the "
        "real ones; set extract.backend: vllm (docs/rehearsal.md)"
    ]


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "kimi_k25", "kimi_k25_int4"])
def test_rehearsal_extraction_on_real_widths(tmp_path, kind):
    """tests/support/vllm_gpu_check.py rehearsal: vLLM builds the target from its config.json
    alone, the extractor writes a complete, finite shard of non-zero states marked as a
    rehearsal's, and a real training refuses it."""
    need_cuda(VLLM_PYTHON)
    proc = subprocess.run(
        [
            str(VLLM_PYTHON),
            str(REPO / "tests" / "support" / "vllm_gpu_check.py"),
            "rehearsal",
            str(tmp_path),
        ]
        + [kind],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads((tmp_path / f"{kind}.rehearsal.json").read_text())
    assert result["rehearsal"] is True and result["rehearsal_attr"] == 1, result
    assert result["final_hidden_std"] > 0, result
    assert result["layer_ids"] == ([2, 16, 29, 32] if kind == "llama" else [1, 2, 3, 4])
    if os.environ.get("EYRIE_GPU_TABLE"):  # where to keep the figures (docs/rehearsal.md)
        Path(os.environ["EYRIE_GPU_TABLE"]).with_suffix(f".{kind}.json").write_text(
            json.dumps(result, indent=1)
        )
    with pytest.raises(ShardError, match="a hidden-state shard of a rehearsal"):
        check_rehearsal([Path(result["shard"])], rehearsal=False)


@pytest.mark.gpu
@pytest.mark.slow
def test_whole_tiny_dag_as_a_rehearsal(tmp_path):
    """The rehearsal on a GPU, end to end: the tiny config with extract.backend vllm and the
    overlay runs to eval_vllm.json under results/tiny.rehearsal/, every file marked."""
    need_cuda(VLLM_PYTHON)
    convs = demo_conversations(tmp_path / "convs.jsonl", {"demo": {"num_conversations": 60}})
    assert convs.returncode == 0, convs.stderr
    config = write_tiny(
        tmp_path,
        extract={"backend": "vllm"},
        vllm={"python": str(VLLM_PYTHON), "gpu_memory_utilization": 0.5},
    )
    overlay = REPO / "config" / "rehearsal.yaml"
    proc = run_snakemake(tmp_path, "--cores", "4", configfiles=(config, overlay), timeout=1500)
    logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in tmp_path.glob("logs/**/*.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:] + logs
    results = tmp_path / "results" / "tiny.rehearsal"
    assert not (tmp_path / "results" / "tiny").exists()
    assert json.loads((results / "preflight.json").read_text())["rehearsal"] is True
    assert read_meta(results / "hidden" / "shard_000.h5").rehearsal is True
    assert json.loads((results / "train" / "train.json").read_text())["rehearsal"] is True
    assert json.loads((results / "draft.json").read_text())["rehearsal"] is True
    report = json.loads((results / "eval" / "eval_vllm.json").read_text())
    assert report["rehearsal"] is True and report["counters"]["num_drafts"] > 0
    engine_log = (tmp_path / "logs/tiny.rehearsal/extract_engine/engine_000.log").read_text()
    assert "weights random (rehearsal: load_format dummy)" in engine_log
    if os.environ.get("EYRIE_GPU_TABLE"):
        Path(os.environ["EYRIE_GPU_TABLE"]).with_suffix(".dag.json").write_text(
            json.dumps(
                {
                    "eval_vllm": report,
                    "benchmarks": {
                        p.name: p.read_text()
                        for p in sorted((results / "benchmarks").rglob("*.tsv"))
                    },
                },
                indent=1,
            )
        )

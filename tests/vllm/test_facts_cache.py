"""The installed vLLM's facts kept on disk (eyrie.vllm.facts_cache): read once per environment and
config, read again after anything they depend on changed, never a failure of their own."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest

from eyrie.vllm import facts as facts_mod
from eyrie.vllm import facts_cache
from tests.support.vllm_helpers import LLAMA, VLLM_PYTHON, need_vllm

FACTS = {"version": "0.22.0", "model_type": "llama", "architecture": "LlamaForCausalLM"}


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """The cache in tmp_path, and the number of times read_facts ran (a stand-in reader)."""
    monkeypatch.setenv(facts_cache.ENV, str(tmp_path / "facts"))
    facts_cache.environment_key.cache_clear()
    reads = []

    def read_facts_stand_in(config):
        reads.append(config)
        return facts_mod.VllmFacts.from_json({**FACTS, **_empty_fields()})

    monkeypatch.setattr(facts_mod, "read_facts", read_facts_stand_in)
    yield reads
    facts_cache.environment_key.cache_clear()


def _empty_fields() -> dict:
    return {
        "architecture_class": None,
        "model_class_found": True,
        "layer_class_found": True,
        "layer_params": None,
        "layer_required": None,
        "embed_method": None,
    }


def test_read_once_per_config(kept, tmp_path):
    first = facts_mod.gather_facts(LLAMA)
    again = facts_mod.gather_facts(dict(LLAMA))
    assert len(kept) == 1 and again == first
    other = {**LLAMA, "num_hidden_layers": LLAMA["num_hidden_layers"] + 1}
    facts_mod.gather_facts(other)
    assert len(kept) == 2
    assert len(list((tmp_path / "facts").glob("*.json"))) == 2


def test_vllm_variables_and_eyrie_source_are_in_the_key(kept, monkeypatch, tmp_path):
    facts_mod.gather_facts(LLAMA)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")  # preflight's probe sets it: logging only
    facts_cache.environment_key.cache_clear()
    facts_mod.gather_facts(LLAMA)
    assert len(kept) == 1
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    facts_cache.environment_key.cache_clear()
    facts_mod.gather_facts(LLAMA)
    assert len(kept) == 2
    # an edit of eyrie's source (a copy of it here, one file changed) reads the facts again
    source = tmp_path / "eyrie"
    for path in facts_cache.EYRIE_SOURCE.rglob("*.py"):
        dest = source / path.relative_to(facts_cache.EYRIE_SOURCE)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(path.read_bytes())
    monkeypatch.setattr(facts_cache, "EYRIE_SOURCE", source)
    facts_cache.environment_key.cache_clear()
    facts_mod.gather_facts(LLAMA)
    assert len(kept) == 2  # the same source: the same entry
    (source / "vllm" / "probe.py").write_text("# edited\n")
    facts_cache.environment_key.cache_clear()
    facts_mod.gather_facts(LLAMA)
    assert len(kept) == 3


def test_a_job_asking_while_another_reads_them_waits_then_loads_them(kept, monkeypatch):
    # compile-kernels reads them at the workflow's start; preflight's probe asks meanwhile
    reader = facts_mod.read_facts

    def slow(config):
        time.sleep(1.0)
        return reader(config)

    monkeypatch.setattr(facts_mod, "read_facts", slow)
    first = threading.Thread(target=facts_mod.gather_facts, args=(LLAMA,))
    first.start()
    time.sleep(0.3)  # the first holds the lock now
    start = time.monotonic()
    got = facts_mod.gather_facts(LLAMA)
    waited = time.monotonic() - start
    first.join()
    assert len(kept) == 1 and got.version == FACTS["version"] and waited > 0.4


def test_a_damaged_entry_is_read_again(kept):
    facts_mod.gather_facts(LLAMA)
    path = facts_cache.entry_path(LLAMA)
    path.write_text('{"facts": ')  # cut short
    facts_mod.gather_facts(LLAMA)
    assert len(kept) == 2
    assert json.loads(path.read_text())["facts"]["version"] == "0.22.0"


def test_unwritable_folder_is_a_warning(kept, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(facts_cache.ENV, str(blocker / "facts"))
    got = facts_mod.gather_facts(LLAMA)
    assert got.version == "0.22.0"
    assert "the vLLM facts were not kept" in caplog.text and str(blocker) in caplog.text


def test_no_folder_no_cache(monkeypatch, kept):
    monkeypatch.delenv(facts_cache.ENV, raising=False)
    facts_mod.gather_facts(LLAMA)
    facts_mod.gather_facts(LLAMA)
    assert len(kept) == 2


@pytest.mark.slow
@need_vllm
def test_kept_facts_need_no_vllm_import(tmp_path):
    """In the real vLLM environment: the second process reads the first one's facts without
    importing vLLM, and they are the same."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    code = (
        "import json, sys; from eyrie.vllm.facts import gather_facts; "
        f"f = gather_facts(json.load(open({str(config)!r}))); "
        "print(json.dumps({'vllm': 'vllm' in sys.modules, 'facts': f.to_json()}))"
    )
    env = {**os.environ, facts_cache.ENV: str(tmp_path / "facts"), "VLLM_LOGGING_LEVEL": "ERROR"}
    env.pop("PYTHONPATH", None)

    def run(env: dict) -> dict:
        out = subprocess.run(
            [str(VLLM_PYTHON), "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(env), run(env)
    assert first["vllm"] and not second["vllm"]
    assert second["facts"] == first["facts"]
    assert first["facts"]["version"].startswith("0.")
    # the extraction engine and the evaluation ask without preflight's quiet logging: the same
    # entry, no vLLM import
    loud = {k: v for k, v in env.items() if k != "VLLM_LOGGING_LEVEL"}
    third = run(loud)
    assert not third["vllm"] and third["facts"] == first["facts"]
    assert len(list((tmp_path / "facts").glob("*.json"))) == 1

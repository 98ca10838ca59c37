"""The regenerate stage: shard assignment, the round loop (turns all/last, tool-call turns kept,
cut and failed records counted, the template switches), the Hugging Face backend on a tiny target,
the vLLM entry's CPU side, and the workflow's DAG with data.regenerate on and off."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from eyrie import cli
from eyrie.chat.records import to_conversation
from eyrie.config.sections import RegenSettings
from eyrie.core.errors import DataError
from eyrie.demo.tokenizer import CHAT_TEMPLATE, build_chat_tokenizer
from eyrie.regenerate import regenerate_vllm
from eyrie.regenerate.jobs import Generated, Job, opens_think, parse_response, split_at_end
from eyrie.regenerate.regeneration import (
    ShardPaths,
    Stats,
    regenerate_shard,
    run_rounds,
    shard_records,
)
from tests.support import REPO
from tests.support.models import random_model, save_target, spread_weights, tiny_llama
from tests.support.stages import stage_args
from tests.support.vllm_helpers import need_cuda
from tests.support.workflow import TINY, job_table, run_snakemake

TEXTS = [
    "What is a list? A list is a mutable sequence of items.",
    "Explain tuples and dictionaries in Python. A tuple is immutable.",
    "Thanks! How do I sort a list? Use sorted(x) or x.sort().",
    "<think>reasoning</think> call the tool, the tool answered",
] * 10


def msgs(*turns, **extra):
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


MULTI = msgs(
    ("system", "You are terse."),
    ("user", "What is a list?"),
    ("assistant", "A list is a sequence."),
    ("user", "How do I sort a list?"),
    ("assistant", "Use sorted(x)."),
)
SINGLE = msgs(("user", "What is a tuple?"), ("assistant", "An immutable sequence."))
CALL = {"type": "function", "function": {"name": "lookup", "arguments": "{}"}}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
TOOL_RECORD = {
    "messages": [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "the tool answered", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It says so."},
    ],
    "tools": TOOLS,
}


def settings(kwargs=None, **regen) -> dict:
    base = {"num_shards": 1, "max_new_tokens": 16, "batch_size": 4}
    data = {"data": {"chat_template_kwargs": kwargs}} if kwargs is not None else {}
    return {"regenerate": {**base, **regen}, **data}


def cfg(kwargs=None, **regen) -> RegenSettings:
    return RegenSettings.from_settings(settings(kwargs, **regen))


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer(TEXTS, vocab_size=400)


class Scripted:
    """A backend that answers each prompt from a script: the answer names the prompt's last
    user text; `cut` and `boom` are substrings of prompts to cut or to fail on."""

    context = None

    def __init__(self, tok, batch_size=4, cut=(), boom=(), answer=None):
        self.tokenizer, self.batch_size, self.cut, self.boom = tok, batch_size, cut, boom
        self.answer = answer or (lambda prompt: "Re: " + prompt.split("user\n")[-1][:12])
        self.prompts: list[str] = []
        self.calls: list[int] = []

    def generate(self, prompts):
        texts = [self.tokenizer.decode(p) for p in prompts]
        self.calls.append(len(prompts))
        if any(b in t for t in texts for b in self.boom):
            raise RuntimeError("the device fell over")
        self.prompts += texts
        out = []
        for text in texts:
            ids = self.tokenizer.encode(self.answer(text), add_special_tokens=False)
            out.append(Generated(ids, not any(c in text for c in self.cut)))
        return out


def jobs_of(*records, turns="all"):
    return [Job.start(f"f:{i}", to_conversation(r), turns) for i, r in enumerate(records)]


# ----------------------------------------------------------------------------- pieces


def test_shard_assignment_counts_every_record(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(SINGLE) + "\n{not json\n\n" + json.dumps(MULTI) + "\n")
    b.write_text("\n".join(json.dumps(SINGLE) for _ in range(4)) + "\n")
    names = [[r.sample_id for r in shard_records([a, b], s, 3)] for s in range(3)]
    # indices 0..6: a:1 a:2 (bad JSON, counted) a:4 b:1 b:2 b:3 b:4; a blank line is no record
    assert names == [[f"{a}:1", f"{b}:1", f"{b}:4"], [f"{a}:2", f"{b}:2"], [f"{a}:4", f"{b}:3"]]


def test_parse_response_moves_a_leading_think_block():
    assert parse_response("<think>\nsteps\n</think>\n\nAnswer.") == {
        "role": "assistant",
        "content": "Answer.",
        "reasoning_content": "steps",
    }
    assert parse_response("Just text <think>x</think>") == {
        "role": "assistant",
        "content": "Just text <think>x</think>",
    }
    # the prompt opened the block (DeepSeek-R1-style generation prompts)
    assert opens_think("<|start|>assistant\n<think>\n") and not opens_think("<think></think>\n")
    assert parse_response("steps</think>Answer.", inside_think=True)["reasoning_content"] == "steps"
    assert parse_response("never closed", inside_think=True)["content"] == ""


def test_split_at_end_drops_the_end_token_and_padding():
    assert split_at_end([5, 6, 3, 0, 0], {3}) == Generated([5, 6], True, 3)
    assert split_at_end([5, 6, 7], {3}) == Generated([5, 6, 7], False)
    assert Generated([5, 6], True).tokens == 3


def test_settings_are_schema_checked():
    with pytest.raises(DataError, match="regenerate.turns"):
        RegenSettings.from_settings(settings(turns="first"))
    assert cfg().non_text == "drop" and cfg().chat_template_kwargs == {}
    off = {"enable_thinking": False}
    assert cfg(off).chat_template_kwargs == off
    with pytest.raises(
        DataError, match="regenerate.thinking: .* replaced by data.chat_template_kw"
    ):
        RegenSettings.from_settings(settings(thinking="off"))


# ----------------------------------------------------------------------------- the rounds


def test_turns_all_regenerates_in_order_with_regenerated_history(tok):
    backend = Scripted(tok)
    (job,) = jobs_of(MULTI)
    run_rounds(backend, [job], cfg(), Stats())
    first, second = backend.prompts
    assert job.status == "ok" and job.regenerated == 2
    assert job.messages[2]["content"].startswith("Re: What is")
    assert job.messages[2]["content"] in second  # the history holds the regenerated response
    assert "A list is a sequence." not in second
    assert job.messages[4]["content"].startswith("Re: How do I")
    assert [m["role"] for m in job.messages] == [m["role"] for m in MULTI["messages"]]


def test_turns_last_keeps_earlier_turns(tok):
    backend = Scripted(tok)
    (job,) = jobs_of(MULTI, turns="last")
    run_rounds(backend, [job], cfg(turns="last"), Stats())
    assert job.regenerated == 1 and len(backend.prompts) == 1
    assert job.messages[2]["content"] == "A list is a sequence."
    assert "A list is a sequence." in backend.prompts[0]


def test_tool_call_turns_are_kept_and_counted(tok):
    backend = Scripted(tok)
    (job,) = jobs_of(TOOL_RECORD)
    stats = Stats()
    run_rounds(backend, [job], cfg(), stats)
    stats.add(job)
    assert job.messages[1] == TOOL_RECORD["messages"][1]  # the call, untouched
    assert job.messages[3]["content"].startswith("Re: ") and job.regenerated == 1
    assert stats.kept_tool_turns == 1 and "the tool answered" in backend.prompts[0]
    assert job.line()["tools"] == TOOLS


def test_cut_response_ends_the_record(tok):
    backend = Scripted(tok, cut=("What is a list?",))
    (job,) = jobs_of(MULTI)
    run_rounds(backend, [job], cfg(), Stats())
    line = job.line()
    assert line["status"] == "cut" and line["regenerated_turns"] == 1
    assert line["detail"] == "assistant turn 2: the response hit regenerate.max_new_tokens=16"
    assert len(backend.prompts) == 1  # the later turn is not generated


def test_failure_costs_one_record(tok):
    boom = msgs(("user", "BOOM please"), ("assistant", "x"))
    backend = Scripted(tok, boom=("BOOM",))
    jobs = jobs_of(SINGLE, boom, MULTI)
    run_rounds(backend, jobs, cfg(), Stats())
    assert [j.status for j in jobs] == ["ok", "failed", "ok"]
    assert jobs[1].detail == (
        "assistant turn 1: generation failed: RuntimeError: the device fell over"
    )
    assert backend.calls[0] == 3  # one batch first, then each request alone


def test_empty_response_and_context_limit_fail(tok):
    (empty,) = jobs_of(SINGLE)
    run_rounds(Scripted(tok, answer=lambda p: "<think>only this</think>"), [empty], cfg(), Stats())
    assert empty.status == "failed" and "no text" in empty.detail
    backend = Scripted(tok)
    backend.context = 20
    (long,) = jobs_of(MULTI)
    run_rounds(backend, [long], cfg(), Stats())
    assert long.status == "failed" and "exceeds the target's context of 20 tokens" in long.detail


THINK_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ '<|start|>assistant\n' }}",
    "{{ '<|start|>assistant\n' }}{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think></think>' }}{% elif enable_thinking is defined %}{{ '<think>' }}{% endif %}",
)


@pytest.mark.parametrize(
    "kwargs, tail", [({}, "assistant\n"), ({"enable_thinking": False}, "<think></think>")]
)
def test_template_switches_reach_the_template(tok, kwargs, tail):
    think_tok = build_chat_tokenizer(TEXTS, vocab_size=400)
    think_tok.chat_template = THINK_TEMPLATE
    backend = Scripted(think_tok)
    (job,) = jobs_of(SINGLE)
    run_rounds(backend, [job], cfg(kwargs), Stats())
    assert backend.prompts[0].endswith(tail)


def test_thinking_on_response_inside_the_opened_block(tok):
    think_tok = build_chat_tokenizer(TEXTS, vocab_size=400)
    think_tok.chat_template = THINK_TEMPLATE
    backend = Scripted(think_tok, answer=lambda p: "reasoning</think> call the tool")
    (job,) = jobs_of(SINGLE)
    run_rounds(backend, [job], cfg({"enable_thinking": True}), Stats())
    assert backend.prompts[0].endswith("<think>")
    assert job.messages[1] == {
        "role": "assistant",
        "content": "call the tool",
        "reasoning_content": "reasoning",
    }


def test_shard_file_lines_in_input_order(tok, tmp_path):
    src = tmp_path / "c.jsonl"
    records = [SINGLE, {"bad": 1}, MULTI, TOOL_RECORD, SINGLE]
    src.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "shard_000.jsonl"
    stats = regenerate_shard(Scripted(tok), ShardPaths([str(src)], 0, out), cfg(num_shards=2))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    # shard 0 of 2: records 0, 2, 4; all usable
    assert [x["sample_id"] for x in lines] == [f"{src}:1", f"{src}:3", f"{src}:5"]
    assert [x["regenerated_turns"] for x in lines] == [1, 2, 1]
    assert all(x["status"] == "ok" and "detail" not in x and "tools" not in x for x in lines)
    assert (stats.records, stats.turns, stats.skipped) == (3, 4, 0)
    out1 = tmp_path / "shard_001.jsonl"
    stats = regenerate_shard(Scripted(tok), ShardPaths([str(src)], 1, out1), cfg(num_shards=2))
    assert stats.skipped == 1 and [json.loads(x)["tools"] for x in out1.read_text().splitlines()]
    with pytest.raises(DataError, match="--shard 2: outside 0..1"):
        regenerate_shard(Scripted(tok), ShardPaths([str(src)], 2, out1), cfg(num_shards=2))


# ----------------------------------------------------------------------------- Hugging Face


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    path = tmp_path_factory.mktemp("convs") / "c.jsonl"
    records = [SINGLE, MULTI, TOOL_RECORD, {"bad": 1}, SINGLE, MULTI]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


@pytest.fixture
def only_this_stage(monkeypatch):
    monkeypatch.setattr(cli, "STAGES", {"regenerate": cli.STAGES["regenerate"]})


def run_hf(target, inputs, out, shard=0, **regen):
    text = json.dumps({**settings(device="cpu", **regen), "trust_remote_code": False})
    argv = ["regenerate", "--target", str(target), "--inputs", str(inputs)]
    return cli.main([*argv, "--shard", str(shard), "--out", str(out), "--settings", text])


def lines_of(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def test_hf_greedy_is_deterministic_and_batch_independent(
    random_llama_target, inputs, tmp_path, only_this_stage
):
    runs = []
    for name, batch in (("a", 4), ("b", 4), ("c", 1)):
        out = tmp_path / f"{name}.jsonl"
        assert run_hf(random_llama_target, inputs, out, max_new_tokens=6, batch_size=batch) == 0
        runs.append(out.read_bytes())
    assert runs[0] == runs[1]  # greedy: the same bytes
    assert runs[0] == runs[2]  # left padding changes no response
    lines = lines_of(tmp_path / "a.jsonl")
    assert len(lines) == 5  # the unusable record is skipped
    # a random tiny target never ends a response within 6 tokens: every record is cut at its
    # first regenerated turn, which names it
    assert {x["status"] for x in lines} == {"cut"}
    assert lines[2]["detail"].startswith("assistant turn 3: ")  # the tool-call turn was kept
    assert all(x["regenerated_turns"] == 1 for x in lines)


def test_hf_refuses_the_vllm_backend(
    random_llama_target, inputs, tmp_path, only_this_stage, capsys
):
    assert run_hf(random_llama_target, inputs, tmp_path / "x.jsonl", backend="vllm") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("eyrie regenerate: error: regenerate.backend is vllm")


# ----------------------------------------------------------------------------- vLLM, CPU side


def vllm_settings(**vllm):
    return {**settings(backend="vllm", temperature=0.7, seed=3), "vllm": vllm}


def test_vllm_settings_and_requests(random_llama_target):
    target = random_llama_target
    with pytest.raises(DataError, match="vllm: missing"):
        regenerate_vllm.parse_settings(settings(backend="vllm"))
    with pytest.raises(DataError, match="regenerate.backend is hf"):
        regenerate_vllm.parse_settings({**settings(), "vllm": {}})
    with pytest.raises(DataError, match="--gpu-memory-utilization"):
        regenerate_vllm.parse_settings(vllm_settings(), 1.5)
    rcfg, engine = regenerate_vllm.parse_settings(vllm_settings(tensor_parallel_size=4), 0.5)
    kwargs = regenerate_vllm.engine_kwargs(target, rcfg, engine)
    assert kwargs["tensor_parallel_size"] == 4 and kwargs["gpu_memory_utilization"] == 0.5
    assert kwargs["model"] == str(Path(target).resolve()) and kwargs["skip_tokenizer_init"]
    # the target's context (a round's prompts are not known at the start), prefill in chunks
    context = json.loads((Path(target) / "config.json").read_text())["max_position_embeddings"]
    lengths = {k: kwargs[k] for k in ("max_model_len", "max_num_batched_tokens", "max_num_seqs")}
    assert lengths == {
        "max_model_len": context,
        "max_num_batched_tokens": 16384,
        "max_num_seqs": 1024,
    }
    sampling = regenerate_vllm.sampling_kwargs(rcfg, {3, 7})
    assert sampling == {
        "max_tokens": 16,
        "temperature": 0.7,
        "top_p": 1.0,
        "seed": 3,
        "ignore_eos": True,
        "stop_token_ids": [3, 7],
        "detokenize": False,
    }
    greedy = regenerate_vllm.sampling_kwargs(cfg(backend="vllm"), {3})
    assert greedy["temperature"] == 0.0


def fake_output(prompt, ids, reason):
    return SimpleNamespace(
        prompt_token_ids=prompt,
        outputs=[SimpleNamespace(token_ids=ids, finish_reason=reason)],
    )


def test_vllm_outputs_become_responses(tok):
    class FakeLLM:
        swap = False

        def generate(self, requests, params, use_tqdm):
            prompts = [r["prompt_token_ids"] for r in requests]
            out = [
                fake_output(prompts[0], [5, 6, 3], "stop"),
                fake_output(prompts[1], [5, 6, 7], "length"),
            ]
            return out[::-1] if self.swap else out

    llm = FakeLLM()
    backend = regenerate_vllm.VllmBackend(tok, llm, None, {3}, None)
    assert backend.generate([[1, 2], [1, 4]]) == [
        Generated([5, 6], True, 3),  # stopped at the end token, kept apart
        Generated([5, 6, 7], False),  # finish_reason length: cut
    ]
    llm.swap = True
    with pytest.raises(RuntimeError, match="another order"):
        backend.generate([[1, 2], [1, 4]])


# ----------------------------------------------------------------------------- the workflow


def dry_run(workdir: Path, regenerate: bool) -> str:
    config = json.loads(json.dumps(TINY))
    config["data"]["regenerate"] = regenerate
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    proc = run_snakemake(workdir, "--cores", "2", "-n", "-p", timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def shell_of(out: str, rule: str) -> list[str]:
    blocks = out.split(f"rule {rule}:")[1:]
    return [b.split("Shell command: ", 1)[1].split("\n", 1)[0] for b in blocks]


# the tokenize command of a run without regeneration, as the rule wrote it before the stage
TOKENIZE_BEFORE = (
    "eyrie --threads 1 tokenize --target results/tiny/target --inputs convs.jsonl"
    " --out-dir results/tiny/tokenized --settings '{settings}'"
    " > logs/tiny/tokenize_conversations.log 2>&1"
)


def test_workflow_regenerate_jobs_only_when_enabled(tmp_path):
    (tmp_path / "convs.jsonl").touch()
    off = dry_run(tmp_path, False)
    assert "regenerate_responses" not in off
    data = {
        "conversations": ["convs.jsonl"],
        "max_seq_len": 96,
        "num_eval": 4,
        "num_shards": 4,
        "seed": 0,
        "strict": False,
    }
    before = json.dumps({"data": data, "trust_remote_code": False}, separators=(",", ":"))
    assert shell_of(off, "tokenize_conversations") == [TOKENIZE_BEFORE.format(settings=before)]

    on = dry_run(tmp_path, True)
    jobs = shell_of(on, "regenerate_responses")
    assert len(jobs) == 4 and all(" regenerate --target results/tiny/target" in j for j in jobs)
    assert sorted(j.split("--shard ")[1].split()[0] for j in jobs) == ["000", "001", "002", "003"]
    (tokenize,) = shell_of(on, "tokenize_conversations")
    files = " ".join(f"results/tiny/regenerated/shard_{i:03d}.jsonl" for i in range(4))
    assert f"--out-dir results/tiny/tokenized --regenerated {files} --settings " in tokenize
    assert '"regenerate":true' in tokenize
    # beside the regenerate jobs, the same jobs are planned
    stats_on, stats_off = job_table(on), job_table(off)
    assert stats_on.pop("regenerate_responses") == 4 and stats_on.pop("preflight_regenerate") == 1
    assert stats_on == stats_off


# ----------------------------------------------------------------------------- vLLM on a GPU

VLLM_PYTHON = os.environ.get("EYRIE_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))


def gpu_target(tok, root: Path) -> Path:
    """A random Llama with shapes vLLM's attention kernels take (head_dim 64), in bfloat16."""
    import torch

    config = tiny_llama(
        len(tok),
        tok,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        max_position_embeddings=1024,
    )
    model = random_model(config).to(torch.bfloat16)
    spread_weights(model, 0.05)  # wider logit margins: greedy choices agree across kernels
    return save_target(root / "target", model, tok)


def run_stage(stage: str, target: Path, inputs: Path, out: Path, settings_obj: dict) -> None:
    args = stage_args(stage, target=target, inputs=inputs, shard=0, out=out, settings=settings_obj)
    cmd = [VLLM_PYTHON, "-m", "eyrie.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.gpu
def test_vllm_backend_on_a_gpu_matches_hugging_face(tok, inputs, tmp_path):
    need_cuda(VLLM_PYTHON)
    target = gpu_target(tok, tmp_path)
    regen = {"num_shards": 1, "max_new_tokens": 8, "device": "cuda"}
    hf, vl = tmp_path / "hf.jsonl", tmp_path / "vllm.jsonl"
    run_stage("regenerate", target, inputs, hf, {"regenerate": regen})
    vllm_section = {"dtype": "bfloat16", "enforce_eager": True, "gpu_memory_utilization": 0.3}
    run_stage(
        "regenerate-vllm",
        target,
        inputs,
        vl,
        {"regenerate": {**regen, "backend": "vllm"}, "vllm": vllm_section},
    )
    a, b = lines_of(hf), lines_of(vl)
    assert [x["sample_id"] for x in a] == [x["sample_id"] for x in b] and len(a) == 5
    assert [x["status"] for x in a] == [x["status"] for x in b]
    assert [x["regenerated_turns"] for x in a] == [x["regenerated_turns"] for x in b]
    same = sum(x["messages"] == y["messages"] for x, y in zip(a, b))
    assert same >= 3, (same, a, b)  # bfloat16 kernels differ; most greedy responses agree


def test_the_workflow_gives_the_vllm_backend_its_engine_settings():
    from eyrie.config.rules import settings_param
    from eyrie.config.schema import validate_config
    from eyrie.regenerate.regenerate_vllm import parse_settings

    config = validate_config(
        {
            "target": {"name": "t", "trust_remote_code": True},
            "data": {"regenerate": True},
            "regenerate": {"backend": "vllm"},
            "vllm": {"tensor_parallel_size": 8, "max_model_len": 4096},
        }
    )
    cfg, engine = parse_settings(json.loads(settings_param(config, "regenerate_responses")), 0.7)
    assert cfg.trust_remote_code and engine.tensor_parallel_size == 8
    assert engine.max_model_len == 4096 and engine.gpu_memory_utilization == 0.7
    config["regenerate"]["backend"] = "hf"
    assert "vllm" not in json.loads(settings_param(config, "regenerate_responses"))


def test_regenerated_turns_train_the_exact_ids_the_target_generated(tok):
    """The target's own ids are trained, not a re-encoding of their text: here it writes one
    token per character, which the tokenizer would merge (so the second turn, whose prompt a
    server encodes from the first one's text, starts a sample of its own); a turn whose prompt
    changed since (another template switch) is trained from its text."""
    from eyrie.chat.samples import MaskSettings, masked_samples
    from eyrie.chat.template import ChatTemplate
    from eyrie.data.collect import _generated_ids

    end = tok.convert_tokens_to_ids("<|end|>")

    class OneTokenPerCharacter(Scripted):
        def generate(self, prompts):
            texts = [self.tokenizer.decode(p) for p in prompts]
            answers = [self.answer(text) for text in texts]
            return [Generated(self.spelt(a), True, end) for a in answers]

        def spelt(self, text):
            return [i for c in text for i in self.tokenizer.encode(c, add_special_tokens=False)]

    backend = OneTokenPerCharacter(tok)
    (job,) = jobs_of(MULTI)
    run_rounds(backend, [job], cfg(), Stats())
    line = json.loads(json.dumps(job.line()))
    assert sorted(line["generated"]) == ["2", "4"]
    conv = to_conversation(line)
    conv.generated = _generated_ids(line["generated"], None)
    tpl = ChatTemplate.of(tok)
    samples = masked_samples(tpl, conv, MaskSettings()).samples
    trained = [t for ids, mask in samples for t, bit in zip(ids, mask) if bit]
    assert len(samples) == 2
    spelt = [backend.spelt(job.messages[k]["content"]) + [end] for k in (2, 4)]
    assert trained == spelt[0] + spelt[1]
    assert trained != [
        t for k in (2, 4) for t in tok.encode(job.messages[k]["content"] + "<|end|>")
    ]
    conv.messages[0] = {"role": "system", "content": "You are verbose."}  # prompts changed
    samples = masked_samples(tpl, conv, MaskSettings()).samples
    assert [t for ids, mask in samples for t, bit in zip(ids, mask) if bit] != trained

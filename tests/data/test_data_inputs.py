"""The data stage on the data users have: reasoning, tool calls, thinking templates, compressed
and `datasets` inputs, duplicates, eval prompts kept out of training, regenerated responses."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from eyrie import cli as cli
from eyrie.chat import inputs as inputs_mod
from eyrie.chat import records as records_mod
from eyrie.chat.inputs import read_records
from eyrie.chat.records import RecordError, content_text, to_conversation
from eyrie.chat.samples import MaskSettings, masked_samples, template_traits
from eyrie.config.stages import DataSettings
from eyrie.core.errors import DataError
from eyrie.data.collect import collect_records
from eyrie.data.tokenize import tokenize
from tests.support.models import config_only_llama
from tests.support.template_cases import CASES, family_tokenizer, standin_target, trained_text


def user_assistant(q: str, a: str, **assistant) -> dict:
    return {
        "messages": [
            {"role": "user", "content": q},
            {"role": "assistant", "content": a, **assistant},
        ]
    }


def data(**over) -> DataSettings:
    return DataSettings.from_settings({"data": {"max_seq_len": 4096, **over}})


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_target(folder: Path, template: str) -> Path:
    """A target folder with a published template (a template_cases.PUBLISHED name, or "llama3"
    / "qwen3") over the stand-in vocabulary, and a tiny Llama config."""
    from transformers import AutoTokenizer

    from tests.support.template_cases import FAMILY

    standin_target(folder, FAMILY.get(template, template))
    return config_only_llama(folder, len(AutoTokenizer.from_pretrained(folder)))


def many(n: int, **assistant) -> list[dict]:
    """n multi-turn conversations with reasoning, each its own."""
    return [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} + 1?"},
                {"role": "assistant", "content": f"{i + 1}.", **assistant},
                {"role": "user", "content": f"And {i} + 2?"},
                {"role": "assistant", "content": f"{i + 2}.", "reasoning_content": f"{i}+2."},
            ]
        }
        for i in range(n)
    ]


# ----------------------------------------------------------------------------- messages


def test_reasoning_tool_calls_and_tool_results_reach_the_template():
    conv = to_conversation(CASES["tool_call_string"])
    call, result = conv.messages[2], conv.messages[3]
    assert call["reasoning_content"] == "Ask the tool." and call["content"] == ""
    assert call["tool_calls"][0]["function"]["name"] == "get_weather"
    assert result == {
        "role": "tool",
        "content": "-3 C, snow",
        "tool_call_id": "functions.get_weather:0",
        "name": "get_weather",
    }
    assert conv.tools == CASES["tool_call_string"]["tools"]
    assert to_conversation(conv.to_record()) == conv
    # the other names reasoning goes by; blank reasoning is no reasoning
    for name in ("reasoning", "thinking"):
        got = to_conversation(user_assistant("q", "a", **{name: "why"})).messages[1]
        assert got["reasoning_content"] == "why"
    assert (
        "reasoning_content"
        not in to_conversation(user_assistant("q", "a", reasoning_content="  ")).messages[1]
    )


@pytest.mark.parametrize(
    "assistant, detail",
    [
        ({"content": "", "tool_calls": "get_weather"}, "tool_calls must be a list"),
        ({"content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}, "no function name"),
        (
            {"content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{city"}}]},
            "arguments are not JSON",
        ),
    ],
)
def test_bad_tool_calls_name_the_turn(assistant, detail):
    record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", **assistant}]}
    with pytest.raises(RecordError) as err:
        to_conversation(record)
    assert err.value.reason == "bad_tool_calls" and detail in err.value.detail
    assert "messages[1]" in err.value.detail


def test_non_text_parts_follow_the_policy():
    record = user_assistant("q", "a")
    record["messages"][0]["content"] = [
        {"type": "text", "text": "Describe "},
        {"type": "image_url", "image_url": {"url": "x.png"}},
        {"type": "text", "text": "this."},
    ]
    with pytest.raises(RecordError) as err:
        to_conversation(record)
    assert err.value.reason == "non_text_content" and "data.non_text: keep_text" in str(
        records_mod.REASONS[err.value.reason]
    )
    # the text parts kept as parts (the template gets them as vLLM hands them: joined with "\\n"
    # for a template that takes text, eyrie.chat.template.content_format)
    kept = to_conversation(record, non_text="keep_text")
    parts = [{"type": "text", "text": "Describe "}, {"type": "text", "text": "this."}]
    assert kept.messages[0]["content"] == parts and kept.dropped_parts == 1
    assert content_text(parts) == "Describe \nthis."


# ----------------------------------------------------------------------------- mask modes


def test_thinking_template_trains_every_turn_in_its_own_context():
    tok = family_tokenizer("qwen3")
    conv = to_conversation(CASES["reasoning"])
    with pytest.raises(RecordError, match="not prefix-stable"):
        masked_samples(tok, conv, MaskSettings("prefix"))
    got = masked_samples(tok, conv, MaskSettings("auto"))
    assert got.mode == "per_turn" and len(got.samples) == 2
    second_ids, second_mask = got.samples[1]
    text = tok.decode(second_ids)
    # history as the template renders history (reasoning of turn 1 gone), turn 2 with its own
    assert "Add two and two." not in text and "Three plus three." in text
    assert tok.decode([t for t, m in zip(second_ids, second_mask) if m]).startswith("<think>")


GENERATION_LLAMA = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m.role + "
    "'<|end_header_id|>\\n\\n' }}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content + '<|eot_id|>' }}{% endgeneration %}{% else %}{{ m.content + '<|eot_id|>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def test_generation_mode_uses_the_template_markers():
    tok = family_tokenizer("llama3")
    conv = to_conversation(CASES["multi_turn"])
    tok.chat_template = re.sub(r"\{% (end)?generation %\}", "", GENERATION_LLAMA)
    prefix = masked_samples(tok, conv, MaskSettings("prefix"))
    tok.chat_template = GENERATION_LLAMA
    assert template_traits(tok).generation_marks
    marked = masked_samples(tok, conv, MaskSettings("generation"))
    assert marked.mode == "generation" and marked.samples == prefix.samples


def test_impossible_mask_modes_stop_at_once(tmp_path):
    target = make_target(tmp_path / "qwen3", "qwen3")
    inputs = [write_jsonl(tmp_path / "c.jsonl", many(8))]
    base = {"num_eval": 2, "num_shards": 2}
    for mode, fix in (("generation", "no {% generation %} markers"), ("prefix", "prefix-stable")):
        with pytest.raises(DataError) as err:
            tokenize(target, inputs, tmp_path / "out", {"data": {**base, "mask_mode": mode}})
        message = str(err.value)
        assert message.startswith(f"{target}: data.mask_mode: {mode}") and fix in message
        assert "\n" not in message and "data.mask_mode: auto" in message
    assert not (tmp_path / "out").exists()


def test_thinking_template_end_to_end(tmp_path):
    target = make_target(tmp_path / "qwen3", "qwen3")
    inputs = [write_jsonl(tmp_path / "c.jsonl", many(10, reasoning_content="think"))]
    out = tmp_path / "out"
    report = tokenize(target, inputs, out, {"data": {"num_eval": 2, "num_shards": 2}})
    assert report["records_used"] == 10 and report["records_dropped"] == 0
    masks = report["masks"]
    assert masks["records_by_mode"] == {"prefix": 0, "per_turn": 10, "generation": 0}
    assert masks["samples"] == 20 and masks["template"]["prefix_stable"] is False
    shards = [pq.read_table(out / f"shard_{s:03d}.parquet").to_pylist() for s in range(2)]
    ids = [row["sample_id"] for shard in shards for row in shard]
    assert len(ids) == 16 and all(i.endswith(("#0", "#1")) for i in ids)
    # a record's samples stay on one side of the eval split
    evals = pq.read_table(out / "eval.parquet").to_pylist()
    held = {row["sample_id"].split("#")[0] for row in evals}
    assert len(evals) == 2 and not held & {i.split("#")[0] for i in ids}


def test_reasoning_the_template_drops_is_counted(tmp_path):
    target = make_target(tmp_path / "llama", "llama3")
    inputs = [write_jsonl(tmp_path / "c.jsonl", many(6))]
    report = tokenize(target, inputs, tmp_path / "out", {"data": {"num_eval": 1, "num_shards": 1}})
    assert report["masks"]["template"]["renders_reasoning"] is False
    assert report["masks"]["reasoning_not_rendered"] == 6  # every record's second turn


# ----------------------------------------------------------------------------- inputs


def _records(n: int) -> list[dict]:
    return [user_assistant(f"Question {i}?", f"Answer {i}.") for i in range(n)]


def test_compressed_and_datasets_inputs(tmp_path):
    import datasets

    recs = _records(3)
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.writelines(json.dumps(r) + "\r\n" for r in recs)
    zst = tmp_path / "c.jsonl.zst"
    with pa.CompressedOutputStream(str(zst), "zstd") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs).encode())
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(recs).save_to_disk(str(folder))
    for path in (gz, zst, folder):
        got = [r.obj for r in read_records(path)]
        assert [to_conversation(o) for o in got] == [to_conversation(r) for r in recs], path
    assert [r.line for r in read_records(gz)] == [1, 2, 3]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(recs)}).save_to_disk(
        str(tmp_path / "dd")
    )
    with pytest.raises(DataError, match=r"a DatasetDict folder \(splits train\); name one split"):
        list(read_records(tmp_path / "dd"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="a folder without state.json"):
        list(read_records(tmp_path / "empty"))


def test_a_huge_line_costs_that_record_only(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs_mod, "MAX_RECORD_BYTES", 200)
    path = tmp_path / "c.jsonl"
    lines = [json.dumps(r) for r in _records(3)]
    lines.insert(1, json.dumps(user_assistant("x" * 1000, "y")))
    path.write_text("\n".join(lines) + "\n")
    got = list(read_records(path))
    assert [(r.line, r.error.reason if r.error else None) for r in got] == [
        (1, None),
        (2, "record_too_large"),
        (3, None),
        (4, None),
    ]


def test_a_long_record_is_tokenized_by_its_head_to_the_same_tokens(monkeypatch):
    """A record far longer than max_seq_len: only a head of its text is tokenized (a whole
    60 MB record took 24 GB and 3.5 minutes to keep 256 tokens), and the tokens and mask kept
    are those of the whole text cut to max_seq_len. Short texts are encoded whole."""
    from eyrie.chat import encoding
    from eyrie.chat import samples as turns

    tok = family_tokenizer("llama3")
    words = " ".join(f"w{i % 97}x{i % 13}" for i in range(20000))
    for messages in (
        [{"role": "user", "content": words}, {"role": "assistant", "content": "ok"}],
        [{"role": "user", "content": "why?"}, {"role": "assistant", "content": words}],
    ):
        conv = to_conversation({"messages": messages})
        (whole,) = turns.masked_samples(tok, conv, MaskSettings("prefix")).samples
        encoded = []
        real = encoding.encode
        monkeypatch.setattr(
            encoding, "encode", lambda t, text: encoded.append(len(text)) or real(t, text)
        )
        (head,) = turns.masked_samples(tok, conv, MaskSettings("prefix"), max_tokens=64).samples
        monkeypatch.setattr(encoding, "encode", real)
        assert head[0] == whole[0][:65] and head[1] == whole[1][:65]
        assert max(encoded) < len(words) // 10  # never the whole text


# ----------------------------------------------------------------------------- eval kept out


def test_a_file_listed_twice_puts_no_eval_conversation_in_training(tmp_path):
    tok = family_tokenizer("llama3")
    path = write_jsonl(tmp_path / "c.jsonl", _records(6))
    tally = collect_records(tok, [path, path], data())
    assert len(tally.records) == 6
    assert [d["reason"] for d in tally.dropped] == ["duplicate"] * 6
    assert tally.dropped[0]["detail"] == f"the same conversation as {path}:1"


def test_a_file_of_an_unknown_schema_stops_the_stage_naming_it(tmp_path):
    """A parquet file whose columns are not a conversation format contributed 0 of its
    records with an INFO line only; now the stage stops naming the file and the fix."""
    tok = family_tokenizer("llama3")
    good = write_jsonl(tmp_path / "c.jsonl", _records(6))
    other = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "response": ["c", "d"]}), other)
    with pytest.raises(DataError) as err:
        collect_records(tok, [good, other], data(strict=False))
    assert str(err.value) == (
        f"{other}: none of its 2 records is usable (unknown_format 2 (e.g. {other}:0: no "
        "'messages' or 'conversations' key (keys: ['prompt', 'response']))); fix the file "
        "(docs/data.md#input-files gives the formats read) or remove it from data.conversations"
    )


def test_records_sharing_an_eval_prompt_stay_out_of_training(tmp_path):
    target = make_target(tmp_path / "llama", "llama3")
    recs = _records(6) + [
        user_assistant(f"Question {i}?", f"Another answer {i}.") for i in range(6)
    ]
    inputs = [write_jsonl(tmp_path / "c.jsonl", recs)]
    out = tmp_path / "out"
    report = tokenize(target, inputs, out, {"data": {"num_eval": 3, "num_shards": 1}})
    evals = pq.read_table(out / "eval.parquet").to_pylist()
    train = pq.read_table(out / "shard_000.parquet").to_pylist()
    assert report["dropped_by_reason"]["shares_eval_prompt"] == 3
    eval_prompts = {tuple(r["prompt_ids"]) for r in evals}
    for row in train:
        ids = row["input_ids"]
        assert not any(tuple(ids[: len(p)]) == p for p in eval_prompts)


# ----------------------------------------------------------------------------- regenerated


def _regenerated(path: Path, entries: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def test_regenerated_responses_replace_the_training_records(tmp_path):
    target = make_target(tmp_path / "llama", "llama3")
    source = write_jsonl(tmp_path / "c.jsonl", _records(8))
    entries = []
    for i in range(8):
        record = user_assistant(f"Question {i}?", f"Target says {i}.")
        status = {5: "cut", 6: "failed"}.get(i, "ok")
        entries.append({"sample_id": f"{source}:{i + 1}", **record, "status": status})
    regen = _regenerated(tmp_path / "r.jsonl", entries)
    out = tmp_path / "out"
    settings = {"data": {"num_eval": 2, "num_shards": 1, "regenerate": True}}
    report = tokenize(target, [source], out, settings, [regen])
    tok = family_tokenizer("llama3")
    train = pq.read_table(out / "shard_000.parquet").to_pylist()
    evals = pq.read_table(out / "eval.parquet").to_pylist()
    eval_ids = {r["sample_id"] for r in evals}
    texts = [tok.decode(r["input_ids"]) for r in train]
    assert all("Target says" in t for t in texts) and len(train) + len(eval_ids) <= 8
    why = {f"{source}:6": "regenerate_cut", f"{source}:7": "regenerate_failed"}
    lost = set(why) - eval_ids
    assert len(train) == 6 - len(lost) and report["regenerated"]["records_used"] == len(train)
    assert sorted((f"{d['file']}:{d['line']}", d["reason"]) for d in report["dropped"]) == sorted(
        (x, why[x]) for x in lost
    )
    # eval records keep their original prompts; a stale regenerated file stops the stage
    _regenerated(regen, entries[:3])
    with pytest.raises(DataError, match="not in the regenerated files; they are stale"):
        tokenize(target, [source], tmp_path / "out2", settings, [regen])


def test_cli_takes_the_regenerated_files(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "STAGES", {"tokenize": cli.STAGES["tokenize"]})
    target = make_target(tmp_path / "llama", "llama3")
    source = write_jsonl(tmp_path / "c.jsonl", _records(4))
    regen = _regenerated(
        tmp_path / "r.jsonl",
        [
            {
                "sample_id": f"{source}:{i + 1}",
                **user_assistant(f"Question {i}?", "R."),
                "status": "ok",
            }
            for i in range(4)
        ],
    )
    settings = json.dumps({"data": {"num_eval": 1, "num_shards": 1, "regenerate": True}})
    argv = ["tokenize", "--target", str(target), "--inputs", str(source), "--out-dir"]
    assert (
        cli.main([*argv, str(tmp_path / "o"), "--settings", settings, "--regenerated", str(regen)])
        == 0
    )
    assert cli.main([*argv, str(tmp_path / "p"), "--settings", settings]) == 2  # one-line error


def test_preflight_reports_what_the_template_needs(tmp_path):
    from eyrie.preflight import checks as pf_checks

    for family, stable in (("qwen3", False), ("llama3", True)):
        target = make_target(tmp_path / family, family)
        check = pf_checks.Check([], [])
        _, template = pf_checks.check_tokenizer(target, False, check)
        assert check.problems == [] and template["prefix_stable"] is stable
        assert template["auto_mode"] == ("prefix" if stable else "per_turn")


# ----------------------------------------------------------------------------- the rule, end to end


def _agent(i: int) -> dict:
    record = json.loads(json.dumps(CASES["agent_reasoning"]))
    record["messages"][0]["content"] = f"Weather in Oslo for {i + 2} days?"
    return record


def test_report_counts_turns_by_how_they_were_rendered(tmp_path):
    """Kimi-K2-Thinking: final answers trained with their reasoning, from the in-progress
    rendering; gpt-oss: turns whose parallel calls the template drops are left untrained and
    counted by reason, and the records keep their other turns."""
    target = make_target(tmp_path / "kimi", "kimi_k2_thinking")
    inputs = [write_jsonl(tmp_path / "c.jsonl", [_agent(i) for i in range(6)])]
    report = tokenize(
        target,
        inputs,
        tmp_path / "out",
        {"data": {"num_eval": 1, "num_shards": 1, "max_seq_len": 8192}},
    )
    turns = report["masks"]["turns"]
    assert turns["trained"] == 18 and turns["reasoning_rendered"] == 18
    assert turns["reasoning_in_progress"] == 12 and turns["without_stop_token"] == 0
    assert report["masks"]["template"]["reasoning_in_progress"] is True
    oss = make_target(tmp_path / "oss", "gpt_oss")
    parallel = [json.loads(json.dumps(CASES["parallel_calls"])) for _ in range(3)]
    for i, record in enumerate(parallel):
        record["messages"][0]["content"] += f" ({i})"
    inputs = [write_jsonl(tmp_path / "p.jsonl", [*parallel, *(_agent(i) for i in range(4))])]
    report = tokenize(
        oss,
        inputs,
        tmp_path / "oss_out",
        {"data": {"num_eval": 1, "num_shards": 1, "max_seq_len": 8192}},
    )
    assert report["masks"]["turns_dropped"]["tool_calls_not_rendered"] == 3
    assert report["masks"]["dropped_by_template_rule"] == {}
    assert report["records_used"] == 7 and report["masks"]["turns"]["trained"] == 3 + 4 * 3


def test_a_prompt_that_opens_reasoning_refuses_records_not_the_target(tmp_path, caplog):
    """DeepSeek-R1-Distill opens <think> in every generation prompt and cuts reasoning from
    every turn: records with reasoning train it (as its reasoning parser splits a response),
    records without are dropped with the cause and the fix; the target is never refused."""
    target = make_target(tmp_path / "r1", "deepseek_r1_distill")
    plain = [json.loads(json.dumps(CASES["multi_turn"])) for _ in range(4)]
    thinking = [json.loads(json.dumps(CASES["reasoning"])) for _ in range(4)]
    for i, record in enumerate([*plain, *thinking]):  # each its own first prompt
        next(m for m in record["messages"] if m["role"] == "user")["content"] += f" ({i})"
    inputs = [write_jsonl(tmp_path / "c.jsonl", [*plain, *thinking])]
    settings = {"data": {"num_eval": 1, "num_shards": 1, "max_seq_len": 8192}}
    with caplog.at_level("WARNING"):
        report = tokenize(target, inputs, tmp_path / "out", settings)
    assert report["records_used"] == 4 and report["masks"]["turns"]["reasoning_parsed"] == 8
    assert report["masks"]["dropped_by_template_rule"] == {"reasoning_missing": 4}
    assert "switch thinking off in data.chat_template_kwargs" in caplog.text
    tok = AutoTokenizer.from_pretrained(target)
    rows = pq.read_table(tmp_path / "out" / "shard_000.parquet").to_pylist()
    runs = [run for row in rows for run in trained_text(tok, row["input_ids"], row["loss_mask"])]
    assert "Three plus three.</think>6.<｜end▁of▁sentence｜>" in runs


def test_glm_stop_tokens_come_from_generation_config(tmp_path):
    target = make_target(tmp_path / "glm", "glm_4_6")
    inputs = [write_jsonl(tmp_path / "c.jsonl", [_agent(i) for i in range(4)])]
    out = tmp_path / "out"
    report = tokenize(
        target, inputs, out, {"data": {"num_eval": 1, "num_shards": 1, "max_seq_len": 8192}}
    )
    assert report["masks"]["turns"]["without_stop_token"] == 0
    assert report["masks"]["template"]["stop_tokens"] == [
        "<|endoftext|>",
        "<|observation|>",
        "<|user|>",
    ]
    tok = AutoTokenizer.from_pretrained(target)
    rows = pq.read_table(out / "shard_000.parquet").to_pylist()
    runs = [run for row in rows for run in trained_text(tok, row["input_ids"], row["loss_mask"])]
    assert all(run.endswith(("<|observation|>", "<|user|>")) for run in runs)
    (target / "generation_config.json").unlink()  # no stop token after a turn: eos, counted
    report = tokenize(
        target,
        inputs,
        tmp_path / "out2",
        {"data": {"num_eval": 1, "num_shards": 1, "max_seq_len": 8192}},
    )
    assert report["masks"]["turns"]["stop_appended"] == 12  # 4 records x 3 turns
    assert report["masks"]["turns"]["without_stop_token"] == 0


def test_template_switches_reach_training_and_evaluation_prompts(tmp_path):
    target = make_target(tmp_path / "qwen3", "qwen3")
    inputs = [write_jsonl(tmp_path / "c.jsonl", many(6))]
    off = {"num_eval": 2, "num_shards": 1, "chat_template_kwargs": {"enable_thinking": False}}
    off["max_seq_len"] = 8192
    report = tokenize(target, inputs, tmp_path / "out", {"data": off})
    assert report["masks"]["chat_template_kwargs"] == {"enable_thinking": False}
    tok = family_tokenizer("qwen3")
    for row in pq.read_table(tmp_path / "out" / "eval.parquet").to_pylist():
        assert tok.decode(row["prompt_ids"]).endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
    # the questions of eval.prompts likewise
    from eyrie.chat.template import ChatTemplate
    from eyrie.evaluate.questions import question_prompts

    tpl = ChatTemplate.load(target, kwargs={"enable_thinking": False})
    ((_, ids),) = question_prompts(tpl, [("q:1", "Why?")])
    assert tok.decode(ids).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(DataError, match="data.chat_template_kwargs.tools: set by eyrie"):
        ChatTemplate.load(target, kwargs={"tools": []})


def test_a_template_switch_the_template_never_reads_is_one_line(tmp_path):
    """A misspelt switch (enable_thinkin) rendered every record without enable_thinking, 200 of
    200 records used, in silence; now tokenization (and the parse, for a user's target) stops
    on one line naming the key and the switches the template reads (Qwen3's published template)."""
    from eyrie.chat.keywords import folder_templates, keyword_problems
    from eyrie.chat.template import ChatTemplate

    target = make_target(tmp_path / "qwen3", "qwen3")
    inputs = [write_jsonl(tmp_path / "c.jsonl", many(2))]
    settings = {"num_eval": 1, "num_shards": 1, "chat_template_kwargs": {"enable_thinkin": False}}
    want = (
        "data.chat_template_kwargs.enable_thinkin: the chat template never reads it (it reads "
        "content, enable_thinking, reasoning_content); fix the spelling or remove it"
    )
    with pytest.raises(DataError) as err:
        tokenize(target, inputs, tmp_path / "out", {"data": settings})
    assert str(err.value) == want
    assert not (tmp_path / "out").exists()
    assert keyword_problems({"enable_thinkin": False}, *folder_templates(target)) == [want]
    assert keyword_problems({"enable_thinking": False}, *folder_templates(target)) == []
    # a switch only the tokenizer's own code reads (remote code) is read
    assert (
        keyword_problems({"enable_thinkin": 1}, *folder_templates(target)[:1], ["enable_thinkin"])
        == []
    )
    assert ChatTemplate.load(target, kwargs={"enable_thinking": True}).kwargs


def test_parquet_and_datasets_records_keep_only_their_own_keys(tmp_path):
    """Arrow gives every row every field of a struct column: the nulls it adds never reach the
    template (Qwen3-Coder would render <parameter=date>None)."""
    import datasets

    def call_record(i: int, args: dict) -> dict:
        record = json.loads(json.dumps(CASES["tool_call_object"]))
        record["messages"][1]["content"] = f"Weather {i}?"
        record["messages"][2]["tool_calls"][0]["function"]["arguments"] = args
        return record

    recs = [call_record(0, {"city": "Oslo"}), call_record(1, {"city": "Bergen", "date": "today"})]
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "c.parquet")
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "ds"))
    for path in (tmp_path / "c.parquet", tmp_path / "ds"):
        got = [to_conversation(r.obj) for r in read_records(path)]
        assert got == [to_conversation(r) for r in recs], path
    target = make_target(tmp_path / "coder", "qwen3_coder")
    settings = {"data": {"num_eval": 1, "num_shards": 1, "max_seq_len": 8192}}
    tokenize(target, [tmp_path / "c.parquet"], tmp_path / "out", settings)
    tok = AutoTokenizer.from_pretrained(target)
    rows = pq.read_table(tmp_path / "out" / "eval.parquet").to_pylist()
    rows += pq.read_table(tmp_path / "out" / "shard_000.parquet").to_pylist()
    assert not any("None" in tok.decode(row["input_ids"]) for row in rows)


# a stand-in for a template that fails on every conversation (as a community port of
# DeepSeek-V3.2's encoder does)
BROKEN = "{{ raise_exception('this template needs encoding_dsv32.py: ' + messages[0].role) }}"


def test_a_template_that_renders_nothing_stops_at_once(tmp_path):
    target = make_target(tmp_path / "broken", "llama3")
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "chat_template.jinja").write_text(BROKEN)
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    inputs = [write_jsonl(tmp_path / "c.jsonl", _records(6))]
    with pytest.raises(DataError) as err:
        tokenize(
            target,
            inputs,
            tmp_path / "out",
            {"data": {"num_eval": 1, "num_shards": 1, "max_seq_len": 8192}},
        )
    message = str(err.value)
    assert "cannot render a conversation" in message and "needs encoding_dsv32.py: user" in message
    assert "use data.mask_mode: auto" not in message and "\n" not in message


def test_a_file_cut_to_nothing_by_max_seq_len_offers_raising_it(tmp_path):
    """Every record of a file cut before its first assistant token by data.max_seq_len: the
    line said only "fix the file or remove it"; the file is fine, the setting is not."""
    target = make_target(tmp_path / "qwen3", "qwen3")
    inputs = [write_jsonl(tmp_path / "c.jsonl", many(3))]
    with pytest.raises(DataError) as err:
        tokenize(target, inputs, tmp_path / "out", {"data": {"max_seq_len": 8}})
    assert str(err.value).startswith(f"{inputs[0]}: none of its 3 records is usable (")
    assert str(err.value).endswith(
        "or remove it from data.conversations, or raise data.max_seq_len (now 8): 3 records "
        "have no assistant token within it"
    )

"""eyrie.data.tokenize: golden loss masks, bad-input reasons, truncation, the CLI end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eyrie import cli as cli
from eyrie.chat.records import REASONS, RawRecord, RecordError, content_text, to_messages
from eyrie.chat.samples import prompt_ids, render_with_mask
from eyrie.chat.template import load_chat_tokenizer
from eyrie.config.stages import DataSettings
from eyrie.core.errors import DataError
from eyrie.data.collect import LISTED_WHEN_SEEN, collect_records, tokenize_record
from eyrie.demo.tokenizer import CHAT_TEMPLATE, build_chat_tokenizer

TEXTS = [
    "What is a list? A list is a mutable sequence of items.",
    "You are terse. Explain tuples and dictionaries in Python.",
    "A tuple is immutable. A dictionary maps keys to values.",
    "Thanks! How do I sort a list? Use sorted(x) or x.sort().",
] * 10

SYSTEM, Q1, A1, Q2, A2 = (
    "You are terse.",
    "What is a list?",
    "A list is a mutable sequence.",
    "How do I sort a list?",
    "Use sorted(x) or x.sort().",
)


def openai(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def sharegpt(*turns):
    return {"conversations": [{"from": r, "value": c} for r, c in turns]}


def data_settings(max_seq_len, strict=False, **data):
    settings = {"data": {"max_seq_len": max_seq_len, "strict": strict, **data}}
    return DataSettings.from_settings(settings)


def collect_examples(tok, paths, max_seq_len, strict, **data):
    """The usable samples in order and the tally, as the stage collects them."""
    tally = collect_records(tok, paths, data_settings(max_seq_len, strict, **data))
    return [e for r in tally.records for e in r.examples], tally


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer(TEXTS, vocab_size=400)


def encode_pieces(tok, pieces):
    """Expected (ids, mask) built independently: each (text, bit) piece tokenized on its own."""
    ids, mask = [], []
    for text, bit in pieces:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [bit] * len(piece)
    return ids, mask


# both forms in one Parquet table (a row of the other form reads back null in that column)
MIXED = pa.schema(
    [
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
    ]
)


def runs(mask):
    """[start, end) index ranges of consecutive 1s."""
    out, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            out.append((start, i))
            start = None
    return out


# ----------------------------------------------------------------------------- golden masks


def test_golden_mask_openai_single_turn(tok):
    messages = to_messages(openai(("system", SYSTEM), ("user", Q1), ("assistant", A1)))
    ids, mask = render_with_mask(tok, messages)
    prompt = (
        f"<|bos|><|start|>system\n{SYSTEM}<|end|>\n<|start|>user\n{Q1}<|end|>\n<|start|>assistant\n"
    )
    # a sample ends with the stop token: the template's "\n" after it is never generated
    assert (ids, mask) == encode_pieces(tok, [(prompt, 0), (A1 + "<|end|>", 1)])

    first = mask.index(1)
    last = len(mask) - 1 - mask[::-1].index(1)
    assert tok.decode([ids[first - 1]]) == "\n"
    assert tok.decode(ids[:first]).endswith("<|start|>assistant\n")
    assert A1.startswith(tok.decode([ids[first]]))
    assert ids[last] == tok.convert_tokens_to_ids("<|end|>")
    assert tok.decode(ids[first : last + 1]) == A1 + "<|end|>"
    assert ids[0] == tok.convert_tokens_to_ids("<|bos|>")
    assert runs(mask) == [(first, last + 1)]  # system and user tokens unmasked


def test_golden_mask_sharegpt_multi_turn(tok):
    record = sharegpt(("system", SYSTEM), ("human", Q1), ("gpt", A1), ("human", Q2), ("gpt", A2))
    messages = to_messages(record)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    ids, mask = render_with_mask(tok, messages)
    expected = encode_pieces(
        tok,
        [
            (
                f"<|bos|><|start|>system\n{SYSTEM}<|end|>\n<|start|>user\n{Q1}<|end|>\n<|start|>assistant\n",
                0,
            ),
            (A1 + "<|end|>", 1),
            (f"\n<|start|>user\n{Q2}<|end|>\n<|start|>assistant\n", 0),
            (A2 + "<|end|>", 1),
        ],
    )
    assert (ids, mask) == expected
    spans = runs(mask)
    assert [tok.decode(ids[a:b]) for a, b in spans] == [A1 + "<|end|>", A2 + "<|end|>"]
    for a, _ in spans:
        assert tok.decode([ids[a - 1]]) == "\n" and tok.decode(ids[:a]).endswith(
            "<|start|>assistant\n"
        )
    # the same conversation in OpenAI form renders identically
    same = to_messages(
        openai(("system", SYSTEM), ("user", Q1), ("assistant", A1), ("user", Q2), ("assistant", A2))
    )
    assert render_with_mask(tok, same) == (ids, mask)


def test_conversation_opening_with_assistant(tok):
    """An assistant turn with no message before it answers no prompt a server renders: it is
    context for the turns after it, not trained (as SpecForge and speculators treat it)."""
    messages = to_messages(openai(("assistant", A1), ("user", Q1), ("assistant", A2)))
    ids, mask = render_with_mask(tok, messages)
    assert [tok.decode(ids[a:b]) for a, b in runs(mask)] == [A2 + "<|end|>"]
    assert A1 in tok.decode(ids)
    assert tok.decode(prompt_ids(tok, messages)).endswith(f"{Q1}<|end|>\n<|start|>assistant\n")
    with pytest.raises(RecordError, match="answers no prompt"):
        to_messages(openai(("assistant", A1), ("user", Q1)))


def test_prompt_ids_is_prefix_before_first_assistant(tok):
    messages = to_messages(
        openai(("system", SYSTEM), ("user", Q1), ("assistant", A1), ("user", Q2), ("assistant", A2))
    )
    ids, mask = render_with_mask(tok, messages)
    prompt = prompt_ids(tok, messages)
    assert ids[: len(prompt)] == prompt and mask[len(prompt)] == 1 and not any(mask[: len(prompt)])


# ----------------------------------------------------------------------------- truncation


def test_truncation(tok):
    raw = RawRecord(
        "x.jsonl", 1, openai(("user", Q1), ("assistant", A1), ("user", Q2), ("assistant", A2))
    )
    full_ids, full_mask = render_with_mask(tok, to_messages(raw.obj))
    cut = runs(full_mask)[0][0] + 2  # keeps two tokens of the first answer
    record = tokenize_record(tok, raw, data_settings(cut))
    (example,) = record.examples
    assert (
        record.truncated
        and example.input_ids == full_ids[:cut]
        and example.loss_mask == full_mask[:cut]
    )
    assert sum(example.loss_mask) == 2
    record = tokenize_record(tok, raw, data_settings(len(full_ids)))
    assert not record.truncated and record.examples[0].input_ids == full_ids
    with pytest.raises(RecordError) as err:
        tokenize_record(tok, raw, data_settings(runs(full_mask)[0][0]))  # only the prompt fits
    assert err.value.reason == "no_assistant_tokens_after_truncation"


# ----------------------------------------------------------------------------- bad inputs

GOOD = json.dumps(openai(("user", Q1), ("assistant", A1)))


def good(n: int) -> str:
    """A usable record of its own (identical records are one conversation: `duplicate`)."""
    return json.dumps(openai(("user", f"{Q1} ({n})"), ("assistant", A1)))


# str, written as UTF-8 with surrogateescape: "\udce9" is the lone (Latin-1) byte 0xe9
BAD = {
    "bad_encoding": GOOD.replace("list", "caf\udce9"),
    "bad_json": '{"messages": [',
    # past Python's recursion limit (a RecursionError in the JSON reader), and past MAX_DEPTH
    "too_deep": '{"messages": [{"role": "user", "content": '
    + "[" * 100_000
    + "]" * 100_000
    + "}]}",
    "too_many_turns": json.dumps(openai(*[("user", Q1), ("assistant", A1)] * 2049)),
    "unknown_format": json.dumps({"text": "hello"}),
    "unknown_role": json.dumps(openai(("function", "x"), ("assistant", A1))),
    "no_assistant_turn": json.dumps(openai(("system", SYSTEM), ("user", Q1))),
    "empty_content": json.dumps(openai(("user", Q1), ("assistant", "  "))),
    "non_text_content": json.dumps(
        openai(
            ("user", [{"type": "text", "text": Q1}, {"type": "image_url", "image_url": {}}]),
            ("assistant", A1),
        )
    ),
    "no_assistant_tokens_after_truncation": json.dumps(
        openai(("user", "word " * 80), ("assistant", A1))
    ),
    "bad_tool_calls": json.dumps(
        {"messages": [{"role": "user", "content": Q1}, {"role": "assistant", "tool_calls": "x"}]}
    ),
    "duplicate": GOOD,  # the first line's conversation again
}
# reasons of the later steps, tested where those are
LATER = {"template_error", "record_too_large", "shares_eval_prompt"}
LATER |= {"regenerate_cut", "regenerate_failed", "template_rule"}  # template_rule: test_templates
MAX_LEN = 48


def write_lines(path: Path, lines: list[str]) -> None:
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"))


def test_reason_list_is_complete():
    assert set(BAD) | LATER == set(REASONS)


def test_bad_records_counted_with_line_numbers(tok, tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [GOOD, ""]  # the blank line 2 is skipped but still counts for numbering
    for i, reason in enumerate(BAD):
        lines += [BAD[reason], good(i)]
    write_lines(path, lines)
    examples, tally = collect_examples(tok, [path], MAX_LEN, strict=False)
    assert [(d["line"], d["reason"]) for d in tally.dropped] == [
        (3 + 2 * i, r) for i, r in enumerate(BAD)
    ]
    assert all(
        d["file"] == str(path) and "\n" not in d["detail"] and d["detail"] for d in tally.dropped
    )
    assert [e.sample_id for e in examples] == [
        f"{path}:{n}" for n in [1, *range(4, 4 + 2 * len(BAD), 2)]
    ]
    assert tally.records_read == 1 + 2 * len(BAD)
    listed = [r for r in REASONS if r not in LISTED_WHEN_SEEN or r in BAD]
    assert tally.by_reason() == {r: int(r in BAD) for r in listed}


@pytest.mark.parametrize("reason", sorted(set(BAD) - {"duplicate"}))
def test_strict_one_line_error(tok, tmp_path, reason):
    path = tmp_path / "data.jsonl"
    write_lines(path, [GOOD, BAD[reason], good(1)])
    with pytest.raises(DataError) as err:
        collect_examples(tok, [path], MAX_LEN, strict=True)
    message = str(err.value)
    assert message.startswith(f"{path}:2: {reason}: ") and "\n" not in message
    assert REASONS[reason] in message


def test_a_hostile_record_costs_itself_only(tok, tmp_path):
    """The survey's hostile lines (issue 41): 100,000 turns (8 MB; it grew to 6.5 GB in
    tokenization) and content nesting 100,000 arrays (a RecursionError and a traceback, even
    with strict: false) are each dropped with their file, line and reason before any turn is
    rendered; the records around them are used."""
    path = tmp_path / "hostile.jsonl"
    turns = json.dumps(openai(*[("user", Q1), ("assistant", A1)] * 50_000))
    write_lines(path, [GOOD, turns, BAD["too_deep"], good(1)])
    examples, tally = collect_examples(tok, [path], MAX_LEN, strict=False)
    assert [(d["line"], d["reason"]) for d in tally.dropped] == [
        (2, "too_many_turns"),
        (3, "too_deep"),
    ]
    assert "100000 turns" in tally.dropped[0]["detail"]
    assert [e.sample_id for e in examples] == [f"{path}:1", f"{path}:4"]


def test_bad_encoding_names_the_byte(tok, tmp_path):
    path = tmp_path / "latin1.jsonl"
    write_lines(path, [GOOD, BAD["bad_encoding"], good(1)])
    examples, tally = collect_examples(tok, [path], MAX_LEN, strict=False)
    assert [e.sample_id for e in examples] == [f"{path}:1", f"{path}:3"]
    (drop,) = tally.dropped
    assert drop["line"] == 2 and "0xe9" in drop["detail"] and "UTF-8" in drop["detail"]


def test_byte_order_mark_keeps_the_first_record(tok, tmp_path):
    jl = tmp_path / "bom.jsonl"
    jl.write_bytes(b"\xef\xbb\xbf" + f"{GOOD}\r\n{good(1)}\r\n".encode())
    js = tmp_path / "bom.json"
    js.write_bytes(b"\xef\xbb\xbf" + f"[{good(2)}]".encode())
    examples, tally = collect_examples(tok, [jl, js], MAX_LEN, strict=False)
    assert [e.sample_id for e in examples] == [f"{jl}:1", f"{jl}:2", f"{js}:0"]
    assert not tally.dropped
    assert examples[0].input_ids == render_with_mask(tok, to_messages(json.loads(GOOD)))[0]


def test_json_not_utf8_is_one_error(tok, tmp_path):
    js = tmp_path / "latin1.json"
    write_lines(js, [f"[{BAD['bad_encoding']}]"])
    with pytest.raises(DataError) as err:
        collect_examples(tok, [js], MAX_LEN, strict=False)
    message = str(err.value)
    assert message.startswith(f"{js}: not UTF-8 (byte 0xe9") and "\n" not in message
    assert message.endswith(REASONS["bad_encoding"])


def parts(*texts):
    return [{"type": "text", "text": t} for t in texts]


def test_text_content_parts_are_joined(tok):
    joined = openai(("system", SYSTEM), ("user", Q1), ("assistant", A1 + "\n" + A2))  # as vLLM
    as_parts = openai(("system", parts(SYSTEM)), ("user", parts(Q1)), ("assistant", parts(A1, A2)))
    # parts are kept and reach a template that takes text joined with "\n", as vLLM joins them
    assert [content_text(m["content"]) for m in to_messages(as_parts)] == [
        m["content"] for m in to_messages(joined)
    ]
    assert render_with_mask(tok, to_messages(as_parts)) == render_with_mask(
        tok, to_messages(joined)
    )
    as_sharegpt = sharegpt(("human", parts(Q1)), ("gpt", parts(A1)))
    assert to_messages(as_sharegpt) == to_messages(
        openai(("user", parts(Q1)), ("assistant", parts(A1)))
    )
    with pytest.raises(RecordError) as err:
        to_messages(openai(("user", parts(" ", "")), ("assistant", A1)))
    assert err.value.reason == "empty_content"


@pytest.mark.parametrize(
    "part, kind",
    [
        ({"type": "image_url", "image_url": {"url": "x"}}, "'image_url'"),
        ({"type": "input_audio", "input_audio": {}}, "'input_audio'"),
        ({"type": "text", "text": None}, "'text'"),
        ("plain", "'str'"),
    ],
)
def test_non_text_part_names_its_type(part, kind):
    record = openai(("user", [*parts(Q1), part]), ("assistant", A1))
    with pytest.raises(RecordError) as err:
        to_messages(record)
    assert err.value.reason == "non_text_content"
    assert f"messages[0].content[1] is a {kind} part; only text parts are supported" in str(
        err.value
    )


def test_parquet_and_json_records_are_indexed(tok, tmp_path):
    js = tmp_path / "a.json"
    js.write_text(
        json.dumps(
            [
                sharegpt(("human", Q1), ("gpt", A1)),
                {"conversations": [{"from": "bot"}]},
                sharegpt(("human", Q2), ("gpt", A2)),
            ]
        )
    )
    pa_path = tmp_path / "b.parquet"
    rows = [
        openai(("user", Q1), ("assistant", A2)),
        sharegpt(("human", Q2), ("gpt", A1)),
        openai(("user", Q2), ("user", A2)),
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=MIXED), pa_path)
    examples, tally = collect_examples(tok, [js, pa_path], MAX_LEN, strict=False)
    assert [e.sample_id for e in examples] == [f"{js}:0", f"{js}:2", f"{pa_path}:0", f"{pa_path}:1"]
    assert [(d["file"], d["line"], d["reason"]) for d in tally.dropped] == [
        (str(js), 1, "unknown_format"),
        (str(pa_path), 2, "no_assistant_turn"),
    ]
    assert (
        examples[3].input_ids
        == render_with_mask(tok, to_messages(openai(("user", Q2), ("assistant", A1))))[0]
    )


def _with_template(tok, template):
    other = build_chat_tokenizer(TEXTS, vocab_size=400)
    other.chat_template = template
    assert other.get_vocab() == tok.get_vocab()
    return other


# Like templates that strip the reasoning of earlier assistant turns: not prefix-stable.
HIDES_OLD_ANSWERS = CHAT_TEMPLATE.replace(
    "message['content']",
    "(message['content'] if message['role'] != 'assistant' or loop.last else '[old]')",
)
RAISES = CHAT_TEMPLATE.replace(
    "{% for message in messages %}",
    "{% for message in messages %}{% if message['content'] == 'boom' %}"
    "{{ raise_exception('boom is not allowed') }}{% endif %}",
)


def test_template_error_not_prefix_stable(tok, tmp_path):
    hiding = _with_template(tok, HIDES_OLD_ANSWERS)
    single = to_messages(openai(("user", Q1), ("assistant", A1)))
    assert render_with_mask(hiding, single) == render_with_mask(tok, single)  # one turn is fine
    multi = to_messages(openai(("user", Q1), ("assistant", A1), ("user", Q2), ("assistant", A2)))
    with pytest.raises(RecordError) as err:
        render_with_mask(hiding, multi)
    assert err.value.reason == "template_error" and "prefix" in str(err.value)

    path = tmp_path / "t.jsonl"
    path.write_text(
        GOOD
        + "\n"
        + json.dumps(openai(*[(m["role"], m["content"]) for m in multi]))
        + "\n"
        + json.dumps(openai(("user", "boom"), ("assistant", A1)))
        + "\n"
    )
    prefix = {"mask_mode": "prefix"}
    examples, tally = collect_examples(hiding, [path], MAX_LEN, strict=False, **prefix)
    assert len(examples) == 2 and [(d["line"], d["reason"]) for d in tally.dropped] == [
        (2, "template_error")
    ]
    raising = _with_template(tok, RAISES)
    examples, tally = collect_examples(raising, [path], MAX_LEN, strict=False)
    assert [(d["line"], d["reason"]) for d in tally.dropped] == [(3, "template_error")]
    assert "boom is not allowed" in tally.dropped[0]["detail"]
    with pytest.raises(DataError, match=rf"^{path}:2: template_error: .*prefix"):
        collect_examples(hiding, [path], MAX_LEN, strict=True, **prefix)
    # auto: the multi-turn record is trained turn by turn, each in its generation context
    examples, tally = collect_examples(hiding, [path], 4 * MAX_LEN, strict=False)
    assert not tally.dropped
    assert [e.sample_id for e in examples] == [
        f"{path}:1",
        f"{path}:2#0",
        f"{path}:2#1",
        f"{path}:3",
    ]


def test_no_chat_template_names_folder(tok, tmp_path):
    bare = build_chat_tokenizer(TEXTS, vocab_size=400)
    bare.chat_template = None
    bare.save_pretrained(tmp_path)
    with pytest.raises(DataError, match=rf"^{tmp_path}: the tokenizer has no chat template"):
        load_chat_tokenizer(tmp_path)


# ----------------------------------------------------------------------------- CLI end to end


def write_inputs(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    qa = [(Q1, A1), (Q2, A2), (SYSTEM, A1), (Q1 + " " + Q2, A2 + " " + A1)]
    jl = folder / "a.jsonl"
    lines = [
        json.dumps(openai(("user", q + f" ({i})"), ("assistant", a + f" ({i})")))
        for i, (q, a) in enumerate(qa * 2)
    ]
    lines.insert(3, BAD["unknown_role"])  # line 4
    jl.write_text("\n".join(lines) + "\n")
    js = folder / "b.json"
    js.write_text(
        json.dumps(
            [
                sharegpt(("system", SYSTEM), ("human", q), ("gpt", a), ("human", q), ("gpt", a))
                for q, a in qa
            ]
        )
    )
    pa_path = folder / "c.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [openai(("user", q), ("assistant", a)) for q, a in qa]
            + [sharegpt(("human", A1), ("gpt", Q1))],
            schema=MIXED,
        ),
        pa_path,
    )
    return [jl, js, pa_path]


E2E_LEN = 48  # truncates the longer conversations, drops none of the usable ones


def settings(**data):
    base = {
        "max_seq_len": E2E_LEN,
        "num_shards": 3,
        "num_eval": 4,
        "seed": 0,
        "strict": False,
        "conversations": ["ignored"],
    }
    return json.dumps({"data": {**base, **data}, "trust_remote_code": False})


@pytest.fixture(autouse=True)
def only_this_stage(monkeypatch):
    """The real `eyrie` entry point, only this stage registered (the others import heavy code)."""
    monkeypatch.setattr(cli, "STAGES", {"tokenize": cli.STAGES["tokenize"]})


def run_cli(target, inputs, out, **data):
    return cli.main(
        [
            "tokenize",
            "--target",
            str(target),
            "--inputs",
            *map(str, inputs),
            "--out-dir",
            str(out),
            "--settings",
            settings(**data),
        ]
    )


def read(path):
    return pq.read_table(path).to_pylist()


def source_records(inputs: list[Path]) -> dict[str, dict]:
    """sample_id -> the record it came from, for write_inputs' .jsonl, .json and .parquet."""
    records = {}
    for line, text in enumerate(inputs[0].read_text().splitlines(), 1):
        records[f"{inputs[0]}:{line}"] = json.loads(text)
    records.update({f"{inputs[1]}:{i}": r for i, r in enumerate(json.loads(inputs[1].read_text()))})
    records.update(
        {
            f"{inputs[2]}:{i}": {k: v for k, v in r.items() if v is not None}
            for i, r in enumerate(read(inputs[2]))
        }
    )
    return records


def test_cli_end_to_end(tok, config_only_target, tmp_path):
    inputs = write_inputs(tmp_path / "in")
    out = tmp_path / "tok"
    assert run_cli(config_only_target, inputs, out) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        ".last-good",  # report.json and eval.parquet, copied: a failed rerun keeps them
        "eval.parquet",
        "report.json",
        "shard_000.parquet",
        "shard_001.parquet",
        "shard_002.parquet",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "tok"]  # no temporaries left

    report = json.loads((out / "report.json").read_text())
    assert report["records_read"] == 9 + 4 + 5 and report["records_used"] == 17
    assert report["dropped"] == [
        {
            "file": str(inputs[0]),
            "line": 4,
            "reason": "unknown_role",
            "detail": report["dropped"][0]["detail"],
        }
    ]
    assert report["dropped_by_reason"]["unknown_role"] == 1 and report["records_dropped"] == 1
    assert "bad_encoding" not in report["dropped_by_reason"]  # listed only when it occurs
    assert report["provenance"]["settings"]["data"]["num_shards"] == 3

    shards = [read(out / f"shard_{s:03d}.parquet") for s in range(3)]
    evals = read(out / "eval.parquet")
    assert [len(s) for s in shards] == [5, 4, 4] and len(evals) == 4
    assert pq.read_schema(out / "shard_000.parquet").types == [
        pa.string(),
        pa.list_(pa.int32()),
        pa.list_(pa.uint8()),
    ]
    assert pq.read_schema(out / "eval.parquet").field("prompt_ids").type == pa.list_(pa.int32())
    ids = [r["sample_id"] for s in [evals, *shards] for r in s]
    assert len(set(ids)) == 17 and f"{inputs[0]}:4" not in ids

    # every row equals the library's rendering of its source record, truncated
    records = source_records(inputs)
    truncated = 0
    for row in [r for s in [evals, *shards] for r in s]:
        messages = to_messages(records[row["sample_id"]])
        full_ids, full_mask = render_with_mask(tok, messages)
        truncated += len(full_ids) > E2E_LEN
        assert row["input_ids"] == full_ids[:E2E_LEN] and row["loss_mask"] == full_mask[:E2E_LEN]
    assert truncated == report["truncated"] > 0
    for row in evals:
        assert row["prompt_ids"] == prompt_ids(tok, to_messages(records[row["sample_id"]]))
    for entry, rows in zip(report["shards"], shards):
        assert entry["tokens"] == sum(len(r["input_ids"]) for r in rows)
        assert entry["assistant_tokens"] == sum(sum(r["loss_mask"]) for r in rows) > 0


def test_cli_counts_bad_encoding(config_only_target, tmp_path):
    inputs = write_inputs(tmp_path / "in")
    latin1 = tmp_path / "in" / "latin1.jsonl"
    write_lines(latin1, [good(1), BAD["bad_encoding"]])
    assert run_cli(config_only_target, [*inputs, latin1], tmp_path / "tok") == 0
    report = json.loads((tmp_path / "tok" / "report.json").read_text())
    assert report["dropped_by_reason"]["bad_encoding"] == 1 and report["records_dropped"] == 2
    assert report["dropped"][-1]["file"] == str(latin1) and report["dropped"][-1]["line"] == 2
    assert report["inputs"][str(latin1)]["records_used"] == 1


def test_cli_deterministic(config_only_target, tmp_path):
    inputs = write_inputs(tmp_path / "in")
    for name in ("one", "two"):
        assert run_cli(config_only_target, inputs, tmp_path / name) == 0
    for name in ("eval.parquet", "shard_000.parquet", "shard_001.parquet", "shard_002.parquet"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert run_cli(config_only_target, inputs, tmp_path / "other", seed=1) == 0

    def order(d: str) -> list:
        return [
            r["sample_id"]
            for n in ("eval", "shard_000")
            for r in read(tmp_path / d / f"{n}.parquet")
        ]

    assert order("one") != order("other") and sorted(order("one")) != sorted(order("other"))


def test_cli_errors_are_one_line(config_only_target, tmp_path, capsys):
    inputs = write_inputs(tmp_path / "in")
    assert run_cli(config_only_target, inputs, tmp_path / "s", strict=True) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"eyrie tokenize: error: {inputs[0]}:4: unknown_role: ")
    assert not (tmp_path / "s").exists()

    assert run_cli(config_only_target, inputs, tmp_path / "few", num_eval=16) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "only 17 usable records" in err and "data.num_eval" in err and "data.num_shards" in err
    assert f"(dropped: unknown_role 1 (e.g. {inputs[0]}:4: messages[" in err

    broken = tmp_path / "in" / "broken.jsonl"
    bad = ["bad_encoding"] * 3 + ["bad_json"] * 2 + ["unknown_role", "no_assistant_turn"]
    write_lines(broken, [BAD[r] for r in bad])
    # a file none of whose records is usable stops the stage, naming it and its reasons
    assert run_cli(config_only_target, [broken, inputs[0]], tmp_path / "none", num_eval=16) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"eyrie tokenize: error: {broken}: none of its 7 records is usable (")
    assert f"(bad_encoding 3 (e.g. {broken}:1: " in err  # the first one's detail
    assert (
        f"bad_json 2 (e.g. {broken}:4), "
        f"unknown_role 1 (e.g. {broken}:6), and 1 more reason(s)); fix the file"
    ) in err

    missing = tmp_path / "in" / "nope.jsonl"
    assert run_cli(config_only_target, [inputs[0], missing], tmp_path / "m") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"eyrie tokenize: error: {missing}: input file not found; fix data.conversations"
    )

"""eyrie eval-prompts: an MT-Bench question.jsonl as an eval set (first turns, the target's chat
template), one-line errors naming the file and line for every kind of bad record."""

from __future__ import annotations

import json

import pytest

from eyrie import cli
from eyrie.demo.tokenizer import build_chat_tokenizer
from eyrie.formats.tokenized import read_prompts

TEXTS = ["what is a prime number", "write a haiku about rain", "explain recursion briefly"] * 4
QUESTIONS = [
    {
        "question_id": 81,
        "category": "writing",
        "turns": ["write a haiku about rain", "now a limerick"],
    },
    {"question_id": 82, "category": "math", "turns": ["what is a prime number"]},
]


@pytest.fixture(scope="module")
def tok():
    """The chat tokenizer of tokenizer_only_target (tests/conftest.py)."""
    return build_chat_tokenizer(TEXTS, vocab_size=200)


def args(target, questions, out):
    return ["eval-prompts", "--target", str(target), "--questions", str(questions), "--out",
            str(out), "--settings", json.dumps({"trust_remote_code": False})]  # fmt: skip


def test_first_turns_through_the_chat_template(tokenizer_only_target, tok, tmp_path):
    folder = tokenizer_only_target
    questions = tmp_path / "question.jsonl"
    lines = [json.dumps(q) for q in QUESTIONS]
    questions.write_text(lines[0] + "\n\n" + lines[1] + "\n")  # a blank line is skipped
    out = tmp_path / "prompts.parquet"
    assert cli.main(args(folder, questions, out)) == 0
    prompts = read_prompts(out, 10, len(tok))
    assert [sid for sid, _ in prompts] == ["question_id:81", "question_id:82"]
    for (_, ids), q in zip(prompts, QUESTIONS):
        want = tok.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}],
            add_generation_prompt=True,
            return_dict=False,
        )
        assert ids == list(want)
    assert "limerick" not in tok.decode(prompts[0][1])  # turn 2 follows the model's own answer


@pytest.mark.parametrize(
    "line, says",
    [
        ('{"question_id": 1, "turns": ["ok"]', "not JSON"),
        ('{"question_id": 1, "category": "x"}', "'turns' must be a non-empty list of strings"),
        ('{"question_id": 1, "turns": []}', "'turns' must be a non-empty list of strings"),
        ('{"question_id": 1, "turns": ["a", 2]}', "'turns' must be a non-empty list of strings"),
        ('{"question_id": 1, "turns": "a question"}', "'turns' must be a non-empty list"),
        ('["a question"]', "'turns' must be a non-empty list of strings"),
        ('{"question_id": 1, "turns": [" "]}', "the first turn is empty"),
    ],
)
def test_bad_record_is_one_line_naming_file_and_line(
    tokenizer_only_target, tmp_path, capsys, line, says
):
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps(QUESTIONS[0]) + "\n" + line + "\n")
    out = tmp_path / "prompts.parquet"
    assert cli.main(args(tokenizer_only_target, questions, out)) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert len(err) == 1 and f"{questions}:2: " in err[0] and says in err[0], err
    assert not out.exists()


def test_empty_file_is_an_error(tokenizer_only_target, tmp_path, capsys):
    questions = tmp_path / "question.jsonl"
    questions.write_text("\n")
    assert cli.main(args(tokenizer_only_target, questions, tmp_path / "p.parquet")) == 2
    assert f"{questions}: no questions" in capsys.readouterr().err

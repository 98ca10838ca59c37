"""An evaluation prompt file in MT-Bench's question format, as an eval set both evaluations read.

`eval.prompts` names a `question.jsonl`: one JSON object a line, {"question_id", "category",
"turns": [str, ...]}. Each question becomes one row of the eval set's layout (eval.parquet's
columns; docs/contracts.md#files): the first turn as the user's message, rendered with the
target's chat template and its generation prompt. Turns 2+ are not evaluated: MT-Bench asks them
after the model's own answer to turn 1, and that answer is what the evaluation measures, not an
input it has. A bad line is one error naming the file, the line and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eyrie.config.stages import PromptSettings
from eyrie.core.errors import DataError
from eyrie.core.io import atomic_path
from eyrie.core.jsonlines import read_json_lines
from eyrie.formats.tokenized import EVAL_SCHEMA

FORMAT = 'one JSON object a line: {"question_id": ..., "turns": ["first user turn", ...]}'


def read_questions(path: str | Path) -> list[tuple[str, str]]:
    """(sample_id "question_id:<id>", first turn) of every line of `path`; blank lines skipped."""
    path = Path(path)
    questions = []
    try:
        for n, record in read_json_lines(path, _not_json):
            questions.append(_question(record, f"{path}:{n}", n))
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read eval.prompts ({exc}); give a {FORMAT} file") from exc
    if not questions:
        raise DataError(f"{path}: no questions; write {FORMAT}")
    return questions


def _not_json(where: str, exc: json.JSONDecodeError) -> DataError:
    return DataError(f"{where}: not JSON ({exc.msg}); write {FORMAT}")


def _question(record, where: str, n: int) -> tuple[str, str]:
    """One line's (sample_id, first turn); the question_id defaults to the line number."""
    turns = record.get("turns") if isinstance(record, dict) else None
    if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
        raise DataError(
            f"{where}: 'turns' must be a non-empty list of strings (got {turns!r:.60}); "
            f"write {FORMAT}"
        )
    if not turns[0].strip():
        raise DataError(f"{where}: the first turn is empty; give it the question's text")
    return f"question_id:{record.get('question_id', n)}", turns[0]


def question_prompts(template, questions: list[tuple[str, str]]) -> list[tuple[str, list[int]]]:
    """(sample_id, prompt ids): each first turn as a user message with the generation prompt
    (`template`: an eyrie.chat.template.ChatTemplate, with data.chat_template_kwargs)."""
    out = []
    for sample_id, text in questions:
        rendered = template.render([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = template.tokenizer.encode(rendered, add_special_tokens=False)
        out.append((sample_id, list(ids)))
    return out


def write_eval_set(path: str | Path, prompts: list[tuple[str, list[int]]]) -> None:
    """The prompts in eval.parquet's layout: input_ids = prompt_ids, no loss (nothing trains)."""
    ids = [p for _, p in prompts]
    table = pa.table(
        {
            "sample_id": [s for s, _ in prompts],
            "input_ids": ids,
            "loss_mask": [[0] * len(p) for p in ids],
            "prompt_ids": ids,
        },
        schema=EVAL_SCHEMA,
    )
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def add_arguments(parser) -> None:
    parser.add_argument("--target", required=True, help="target model folder (its chat template)")
    parser.add_argument("--questions", required=True, help="question.jsonl (MT-Bench format)")
    parser.add_argument("--out", required=True, help="eval set .parquet to write")


def run(args) -> int:
    from eyrie.chat.template import ChatTemplate

    questions = read_questions(args.questions)
    cfg = PromptSettings.from_settings(args.settings)
    template = ChatTemplate.load(args.target, cfg.trust_remote_code, cfg.chat_template_kwargs)
    write_eval_set(args.out, question_prompts(template, questions))
    return 0

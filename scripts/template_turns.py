"""Count, per published chat template, the assistant turns trained exactly as the model generates
them: the trained text of every conversation of tests/support/template_cases.py against the
golden text of tests/templates/golden.json (the reviewed spec), at this tree and at another
revision.

    python scripts/template_turns.py                 # this tree
    python scripts/template_turns.py --rev 105e150   # that revision too (a git worktree)

A turn is right when its trained text is one of the golden texts of its conversation, wrong when
it is not (text the model never generates), missed when a golden text has no trained counterpart;
a conversation the golden drops (its template cannot render it as generated) counts its turns
under `dropped` wherever the revision trained them anyway. The revision's own code does the
masking (its tree first on PYTHONPATH, in a subprocess); the templates, the stand-in tokenizer and
the conversations are this tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"


def trained_runs() -> dict:
    """{template: {case: [trained text runs] or None (dropped)}} by the eyrie on sys.path."""
    sys.path.insert(0, str(TESTS / "support"))
    from template_cases import CASES, PUBLISHED, standin_tokenizer, trained_text

    from eyrie.chat.records import RecordError, to_conversation

    try:  # this tree: a ChatTemplate with the generation config's stop tokens
        from eyrie.chat.samples import MaskSettings, masked_samples
        from eyrie.chat.template import ChatTemplate
    except ImportError:  # before: the bare tokenizer
        from eyrie.chat.template import MaskSettings, masked_samples

        ChatTemplate = None
    out = {}
    for name, spec in PUBLISHED.items():
        tok = standin_tokenizer(name)
        template = tok
        if ChatTemplate is not None:
            stops = [tok.convert_tokens_to_ids(t) for t in spec.stops] or None
            template = ChatTemplate.of(tok, spec.kwargs, stops)
        out[name] = {}
        for case, record in CASES.items():
            try:
                masked = masked_samples(template, to_conversation(record), MaskSettings())
            except RecordError:
                out[name][case] = None
                continue
            runs = [r for ids, mask in masked.samples for r in trained_text(tok, ids, mask)]
            out[name][case] = runs
    return out


def count(runs: dict, golden: dict) -> dict:
    """{template: Counter(right, wrong, missed, dropped)} of `runs` against the golden."""
    table = {}
    for name, cases in golden.items():
        tally = Counter()
        for case, want in cases["cases"].items():
            got = runs[name][case]
            if "dropped" in want:
                tally["dropped"] += len(got or [])
                continue
            golden_runs = Counter(r for sample in want["trained"] for r in sample)
            got_runs = Counter(got or [])
            right = sum((golden_runs & got_runs).values())
            tally["right"] += right
            tally["wrong"] += sum(got_runs.values()) - right
            tally["missed"] += sum(golden_runs.values()) - right
        table[name] = tally
    return table


def runs_at(rev: str) -> dict:
    """trained_runs() of revision `rev`'s package, in a subprocess."""
    root = Path(tempfile.mkdtemp(prefix="eyrie-turns-"))
    tree = root / "tree"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), rev], check=True
    )
    try:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        code = (
            f"import sys, json; sys.path.insert(0, {str(REPO / 'scripts')!r}); "
            "import template_turns as t; print(json.dumps(t.trained_runs()))"
        )
        run = [sys.executable, "-c", code]
        done = subprocess.run(run, env=env, cwd=root, check=True, capture_output=True, text=True)
        return json.loads(done.stdout.splitlines()[-1])
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="also count at this revision")
    args = parser.parse_args()
    golden = json.loads((TESTS / "templates" / "golden.json").read_text())
    columns = {"this tree": count(trained_runs(), golden)}
    if args.rev:
        columns = {args.rev: count(runs_at(args.rev), golden), **columns}
    head = " | ".join(f"{c}: right / wrong / missed / dropped-but-trained" for c in columns)
    print(f"| template | {head} |")
    print("|---|" + "---|" * len(columns))
    for name in golden:
        cells = [
            " / ".join(str(t[name][k]) for k in ("right", "wrong", "missed", "dropped"))
            for t in columns.values()
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

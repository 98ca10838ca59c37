"""Tables of what the turn rule trains on the published chat templates (tests/templates/published).

    python scripts/template_turns.py                  # the reviewed turns, at this tree
    python scripts/template_turns.py --rev 32a3bf8    # ... and at that revision (a git worktree)
    python scripts/template_turns.py --collection     # every vendored template, every config

The first table counts, per hand-reviewed template configuration (tests/templates/reviewed), the
assistant turns whose trained text is the reviewed text (right), trained text no review names
(wrong: text the model never generates, or a turn the review drops) and reviewed texts nothing
trained (missed). The revision's own code does the masking (its tree first on PYTHONPATH, in a
subprocess); the templates, the stand-in tokenizers, the conversations and the reviews are this
tree's. The second table (docs/data.md's) gives, per vendored template and switch, over the
conversations of tests/support/template_cases.py: turns trained, turns not trained by reason
(those of records dropped whole under their first turn's reason), records dropped whole, the
tokens of the samples and the context tokens they repeat (a sample after the first in a record
repeats its context: the overhead of training each turn in the context it is generated in).
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
REVIEWED = TESTS / "templates" / "reviewed"


def _api():
    """The masking functions of the eyrie on sys.path (this tree's, or an older layout's)."""
    import eyrie

    # an editable install would find this tree's eyrie/chat/ beside an older tree's eyrie
    if (Path(eyrie.__file__).parent / "chat").is_dir():
        from eyrie.chat.records import RecordError, to_conversation
        from eyrie.chat.samples import MaskSettings, masked_samples
        from eyrie.chat.template import ChatTemplate
    else:  # before eyrie/chat/
        from eyrie.data.chat import ChatTemplate
        from eyrie.data.records import RecordError, to_conversation
        from eyrie.data.turns import MaskSettings, masked_samples
    return ChatTemplate, RecordError, to_conversation, MaskSettings, masked_samples


def _support():
    sys.path.insert(0, str(TESTS / "support"))
    import template_cases

    return template_cases


def template_of(name: str, kwargs: dict):
    cases = _support()
    ChatTemplate = _api()[0]
    tok = cases.standin_tokenizer(name)
    stops = [tok.convert_tokens_to_ids(t) for t in cases.PUBLISHED[name].stops] or None
    return ChatTemplate.of(tok, kwargs, stops)


def trained_runs() -> dict:
    """{review file: {case: [trained text runs] or None (record dropped)}} by the eyrie on
    sys.path."""
    cases = _support()
    _, RecordError, to_conversation, MaskSettings, masked_samples = _api()
    out = {}
    for path in sorted(REVIEWED.glob("*.json")):
        review = json.loads(path.read_text())
        tpl = template_of(review["template"], review["config"])
        out[path.stem] = {}
        for case in review["cases"]:
            try:
                masked = masked_samples(tpl, to_conversation(cases.CASES[case]), MaskSettings())
            except RecordError:
                out[path.stem][case] = None
                continue
            out[path.stem][case] = [
                run
                for ids, mask in masked.samples
                for run in cases.trained_text(tpl.tokenizer, ids, mask)
            ]
    return out


def count(runs: dict) -> dict:
    """{review file: Counter(right, wrong, missed)} of `runs` against the reviews."""
    table = {}
    for name, cases in runs.items():
        review = json.loads((REVIEWED / f"{name}.json").read_text())
        tally = Counter()
        for case, turns in review["cases"].items():
            want = Counter(t["trained"] for t in turns.values() if "trained" in t)
            got = Counter(cases[case] or [])
            right = sum((want & got).values())
            tally["right"] += right
            tally["wrong"] += sum(got.values()) - right
            tally["missed"] += sum(want.values()) - right
        table[name] = tally
    return table


def runs_at(rev: str) -> dict:
    """trained_runs() of revision `rev`'s package, in a subprocess."""
    root = Path(tempfile.mkdtemp(prefix="eyrie-turns-"))
    tree = root / "tree"
    git = ["git", "-C", str(REPO), "worktree"]
    subprocess.run([*git, "add", "-q", "--detach", str(tree), rev], check=True)
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
        subprocess.run([*git, "remove", "--force", str(tree)], check=False)


def collection() -> list[dict]:
    """One row per vendored template and config (this tree's rule)."""
    from eyrie.chat.records import RecordError, to_conversation
    from eyrie.chat.samples import conversation_samples

    cases = _support()
    rows = []
    for name, spec in sorted(cases.PUBLISHED.items()):
        for config, kwargs in spec.configs.items():
            tpl = template_of(name, kwargs)
            row = {"template": name, "config": config, "trained": 0, "dropped": Counter()}
            row.update(records_dropped=0, tokens=0, overhead=0)
            for record in cases.CASES.values():
                conv = to_conversation(record)
                try:
                    _, encoded, _, counts = conversation_samples(tpl, conv, "auto")
                except RecordError as err:  # every turn of it, under the first one's reason
                    row["records_dropped"] += 1
                    reason = err.reason if err.reason == "template_error" else err.detail
                    turns = [m for m in conv.messages[conv.first_turn() :]]
                    row["dropped"][reason.split(":")[0]] += sum(
                        m["role"] == "assistant" for m in turns
                    )
                    continue
                row["trained"] += counts["trained"]
                row["dropped"].update(counts["dropped"])
                row["tokens"] += sum(len(ids) for ids, _ in encoded)
                row["overhead"] += counts["overhead_tokens"]
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="also count the reviewed turns at this revision")
    parser.add_argument("--collection", action="store_true", help="the whole collection's table")
    args = parser.parse_args()
    if args.collection:
        print(
            "| template | switch | turns trained | turns dropped (reason) | records dropped "
            "| tokens | overhead |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in collection():
            drops = ", ".join(f"{k} {n}" for k, n in sorted(r["dropped"].items()) if n) or "0"
            share = f"{r['overhead']} ({r['overhead'] / max(r['tokens'], 1):.0%})"
            print(
                f"| {r['template']} | {r['config']} | {r['trained']} | {drops} "
                f"| {r['records_dropped']} | {r['tokens']} | {share} |"
            )
        return 0
    columns = {"this tree": count(trained_runs())}
    if args.rev:
        columns = {args.rev: count(runs_at(args.rev)), **columns}
    head = " | ".join(f"{c}: right / wrong / missed" for c in columns)
    print(f"| reviewed template | {head} |")
    print("|---|" + "---|" * len(columns))
    totals = {c: Counter() for c in columns}
    for name in sorted(next(iter(columns.values()))):
        cells = []
        for column, table in columns.items():
            totals[column].update(table[name])
            cells.append(" / ".join(str(table[name][k]) for k in ("right", "wrong", "missed")))
        print(f"| {name} | " + " | ".join(cells) + " |")
    cells = [" / ".join(str(t[k]) for k in ("right", "wrong", "missed")) for t in totals.values()]
    print("| **all** | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

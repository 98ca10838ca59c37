"""Time of the turn rule: conversations through `masked_samples` per second, at this tree and at an
earlier revision (its own eyrie, in a git worktree), on the same records and templates.

    python benchmarks/turn_rule.py --rev 32a3bf8 [--records 200]

Each template of TEMPLATES (a prefix-stable one, one that re-renders the history, one whose
answers come from the in-progress rendering, one with a closed reasoning block) tokenizes
`--records` conversations of tests/support/template_cases.py (the agent loop and the multi-turn
one, numbered so that none repeats) with the stand-in byte-level tokenizer; each revision runs
in its own process, one after the other. Prints the table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = {
    "llama3_1": {},
    "qwen3": {},
    "kimi_k2_thinking": {},
    "glm_4_6": {"enable_thinking": False},
}

CHILD = """
import json, sys, time
sys.path.insert(0, {support!r})
import template_cases as cases
import eyrie
from pathlib import Path
if (Path(eyrie.__file__).parent / "chat").is_dir():
    from eyrie.chat.records import to_conversation
    from eyrie.chat.samples import MaskSettings, masked_samples
    from eyrie.chat.template import ChatTemplate
else:
    from eyrie.data.chat import ChatTemplate
    from eyrie.data.records import to_conversation
    from eyrie.data.turns import MaskSettings, masked_samples
records = json.loads(open({records!r}).read())
out = {{}}
for name, kwargs in {templates!r}.items():
    tok = cases.standin_tokenizer(name)
    stops = [tok.convert_tokens_to_ids(t) for t in cases.PUBLISHED[name].stops] or None
    tpl = ChatTemplate.of(tok, kwargs, stops)
    start, tokens = time.perf_counter(), 0
    for record in records:
        for ids, _ in masked_samples(tpl, to_conversation(record), MaskSettings()).samples:
            tokens += len(ids)
    out[name] = {{"s": time.perf_counter() - start, "tokens": tokens}}
print(json.dumps(out))
"""


def records(n: int) -> list[dict]:
    sys.path.insert(0, str(REPO / "tests" / "support"))
    import template_cases

    out = []
    for k in range(n):
        record = json.loads(
            json.dumps(template_cases.CASES[("agent_reasoning", "multi_turn")[k % 2]])
        )
        first = next(m for m in record["messages"] if m["role"] == "user")
        first["content"] += f" ({k})"
        out.append(record)
    return out


def run(tree: Path, path: Path) -> dict:
    code = CHILD.format(
        support=str(REPO / "tests" / "support"), records=str(path), templates=TEMPLATES
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    run = [sys.executable, "-c", code]  # run from elsewhere: `-c` puts the cwd's eyrie first
    done = subprocess.run(run, env=env, cwd=path.parent, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the earlier revision")
    parser.add_argument("--records", type=int, default=200)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="eyrie-turn-rule-"))
    path = root / "records.json"
    path.write_text(json.dumps(records(args.records)))
    tree = root / "tree"
    git = ["git", "-C", str(REPO), "worktree"]
    subprocess.run([*git, "add", "-q", "--detach", str(tree), args.rev], check=True)
    try:
        before = run(tree, path)
    finally:
        subprocess.run([*git, "remove", "--force", str(tree)], check=False)
    now = run(REPO, path)
    print(f"{args.records} conversations per template; conversations/s (sample tokens)")
    print(f"| template | {args.rev} | this tree | ratio |")
    print("|---|---|---|---|")
    for name in TEMPLATES:
        b, n = before[name], now[name]
        rate_b, rate_n = args.records / b["s"], args.records / n["s"]
        print(
            f"| {name} | {rate_b:.0f} ({b['tokens']:,}) | {rate_n:.0f} ({n['tokens']:,}) "
            f"| {rate_n / rate_b:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

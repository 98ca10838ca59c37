"""One very long record through tokenization: the head that `masked_samples(max_tokens=...)`
encodes against the whole text (what tokenization did before), time and peak memory.

    python benchmarks/long_record.py [--mb 6] [--max-seq-len 256]

Each way runs in its own process (peak RSS from getrusage), on a tiny chat target of
tests/support/train_helpers (character-level tokens: the worst case per byte) and a record whose
user turn is `--mb` MB of text; both must keep the same tokens and mask. Prints the table for
BENCHMARKS.md ("A very long record").
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys
from transformers import AutoTokenizer
from eyrie.chat.records import to_conversation
from eyrie.chat.samples import MaskSettings, masked_samples
tok = AutoTokenizer.from_pretrained({target!r})
conv = to_conversation(json.loads(open({record!r}).read()))
(ids, mask), = masked_samples(tok, conv, MaskSettings("prefix"), max_tokens={max_tokens}).samples
print(json.dumps({{"ids": ids[:{keep}], "mask": mask[:{keep}], "tokens": len(ids)}}))
"""


def run_way(target: Path, record: Path, max_tokens: int | None, keep: int) -> dict:
    code = CHILD.format(
        target=str(target),
        record=str(record),
        max_tokens=max_tokens,
        keep=keep,
    )
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    took = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB, the largest child so far
    return {"s": took, "peak_kib": peak, **json.loads(proc.stdout)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=6.0)
    parser.add_argument("--max-seq-len", type=int, default=256)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.support.train_helpers import save_chat_target

    with tempfile.TemporaryDirectory() as tmp:
        target = save_chat_target(
            Path(tmp) / "target", ["What does json.dumps do? It serializes an object."] * 20
        )
        text = "x y " * int(args.mb * (1 << 20) / 4)
        record = Path(tmp) / "record.json"
        messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
        record.write_text(json.dumps({"messages": messages}))
        # the head first: getrusage gives the largest child so far, so the whole text's peak
        # (larger) is read after it
        head = run_way(target, record, args.max_seq_len, args.max_seq_len)
        whole = run_way(target, record, None, args.max_seq_len)
    same = head["ids"] == whole["ids"] and head["mask"] == whole["mask"]
    print(f"record: {args.mb:g} MB of user text, data.max_seq_len {args.max_seq_len}")
    print("| way | tokens encoded | time | peak memory |")
    print("|---|---|---|---|")
    for name, r in (("whole text (before)", whole), ("head (now)", head)):
        print(
            f"| {name} | {r['tokens']:,} | {r['s']:.1f} s | {r['peak_kib'] / (1 << 20):.2f} GiB |"
        )
    print(f"first {args.max_seq_len} tokens and mask equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

"""eyrie.data.vocab: selection rule, parity with speculators, counting, the CLI end to end."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

from eyrie import cli as cli
from eyrie.core.errors import VocabError
from eyrie.data.vocab import count_assistant_tokens, select_draft_ids, vocab_mappings
from eyrie.demo.tokenizer import build_chat_tokenizer

TEXTS = [
    "What is a list? A list is a mutable sequence.",
    "Use sorted(x) or x.sort() to sort a list.",
] * 10


def ours(counts: dict[int, int], size: int, vocab_size: int):
    dense = np.zeros(vocab_size, dtype=np.int64)
    for tid, n in counts.items():
        dense[tid] = n
    return vocab_mappings(select_draft_ids(dense, size), vocab_size)


def test_selection_by_hand():
    d2t, t2d = ours({5: 3, 2: 3, 9: 1, 7: 5}, 3, 12)  # 7 (5), then the tie 2 < 5 (3 each)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (12,)
    assert d2t.tolist() == [2, 4, 5]  # target ids [2, 5, 7]
    assert torch.nonzero(t2d).flatten().tolist() == [2, 5, 7]
    d2t, t2d = ours({7: 1, 1: 4}, 4, 12)  # two seen, filled with the lowest unused ids 0 and 2
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 2, 7]


@pytest.mark.parametrize("case", ["ties", "fill", "full", "sparse_fill"])
def test_matches_speculators(case):
    rng = np.random.default_rng(list(["ties", "fill", "full", "sparse_fill"]).index(case))
    vocab_size = 500
    if case == "ties":  # many equal counts: order among ties decides the cut
        counts = {
            int(t): int(rng.integers(1, 4)) for t in rng.choice(vocab_size, 300, replace=False)
        }
        size = 64
    elif case == "fill":  # fewer distinct tokens than the draft vocab
        counts = {
            int(t): int(rng.integers(1, 50)) for t in rng.choice(vocab_size, 40, replace=False)
        }
        size = 100
    elif case == "full":
        counts = {int(t): int(rng.integers(1, 1000)) for t in range(vocab_size)}
        size = vocab_size
    else:  # seen ids all high, so every filler id is below them
        counts = {int(t): 1 for t in range(450, 460)}
        size = 30
    want_d2t, want_t2d = build_vocab_mappings_from_distribution(counts, size, vocab_size)
    d2t, t2d = ours(counts, size, vocab_size)
    assert torch.equal(d2t, want_d2t) and torch.equal(t2d, want_t2d)
    assert d2t.dtype == want_d2t.dtype and t2d.dtype == want_t2d.dtype


def test_too_large_draft_vocab_is_one_line():
    with pytest.raises(VocabError) as err:
        select_draft_ids(np.ones(100, dtype=np.int64), 101)
    message = str(err.value)
    assert "vocab.draft_vocab_size" in message and "101" in message and "100" in message
    assert "\n" not in message


def write_shard(path, rows):
    pq.write_table(
        pa.table(
            {
                "sample_id": [f"x:{i}" for i in range(len(rows))],
                "input_ids": pa.array([r[0] for r in rows], pa.list_(pa.int32())),
                "loss_mask": pa.array([r[1] for r in rows], pa.list_(pa.uint8())),
            }
        ),
        path,
    )


def test_counts_only_masked_tokens(tmp_path):
    write_shard(tmp_path / "a.parquet", [([1, 2, 3, 3], [0, 1, 1, 0]), ([3, 4], [1, 1])])
    write_shard(tmp_path / "b.parquet", [([5, 1, 1], [0, 1, 1])])
    counts, stats = count_assistant_tokens([tmp_path / "a.parquet", tmp_path / "b.parquet"], 8)
    assert counts.tolist() == [0, 2, 1, 2, 1, 0, 0, 0]
    assert [(s["records"], s["tokens"], s["assistant_tokens"]) for s in stats] == [
        (2, 6, 4),
        (1, 3, 2),
    ]


def test_bad_shards(tmp_path):
    write_shard(tmp_path / "big.parquet", [([1, 9], [1, 1])])
    with pytest.raises(
        VocabError, match=r"token id 9 is outside the target vocabulary \(vocab_size 8"
    ):
        count_assistant_tokens([tmp_path / "big.parquet"], 8)
    write_shard(tmp_path / "skew.parquet", [([1, 2], [1, 1]), ([1, 2, 3], [1, 1])])
    with pytest.raises(VocabError, match=r"sample x:1: input_ids has 3 tokens but loss_mask 2"):
        count_assistant_tokens([tmp_path / "skew.parquet"], 8)
    with pytest.raises(VocabError, match=r"not found"):
        count_assistant_tokens([tmp_path / "missing.parquet"], 8)


@pytest.fixture(scope="module")
def tok():
    """The chat tokenizer of padded_config_only_target (tests/conftest.py)."""
    return build_chat_tokenizer(TEXTS, vocab_size=320)


@pytest.fixture(autouse=True)
def only_these_stages(monkeypatch):
    """The real `eyrie` entry point, with only the stages this test needs registered."""
    monkeypatch.setattr(cli, "STAGES", {k: cli.STAGES[k] for k in ("tokenize", "vocab")})


def write_conversations(path: Path) -> Path:
    """Four question/answer pairs, twice (numbered: identical records are one), as OpenAI
    `messages` records."""
    pairs = [
        ("What is a list?", "A mutable sequence."),
        ("How to sort?", "Use sorted(x)."),
        ("And a tuple?", "An immutable list."),
        ("Thanks", "You are welcome."),
    ] * 2
    records = (
        {
            "messages": [
                {"role": "user", "content": f"{q} ({i})"},
                {"role": "assistant", "content": f"{a} ({i})"},
            ]
        }
        for i, (q, a) in enumerate(pairs)
    )
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def tokenize_cli(target: Path, conv: Path, out_dir: Path) -> int:
    data = {"max_seq_len": 64, "num_shards": 2, "num_eval": 2, "seed": 0, "strict": True}
    return cli.main(
        [
            *("tokenize", "--target", str(target), "--inputs", str(conv)),
            *("--out-dir", str(out_dir), "--settings", json.dumps({"data": data})),
        ]
    )


def vocab_cli(target: Path, shards: list[Path], out: Path, draft_vocab_size: int) -> int:
    settings = json.dumps({"vocab": {"draft_vocab_size": draft_vocab_size}})
    return cli.main(
        [
            *("vocab", "--target", str(target), "--shards", *map(str, shards)),
            *("--out", str(out), "--settings", settings),
        ]
    )


def test_cli_end_to_end(padded_config_only_target, tmp_path, capsys):
    conv = write_conversations(tmp_path / "c.jsonl")
    assert tokenize_cli(padded_config_only_target, conv, tmp_path / "tok") == 0
    shards = [tmp_path / "tok" / f"shard_{s:03d}.parquet" for s in range(2)]
    out = tmp_path / "vocab" / "vocab.safetensors"
    assert vocab_cli(padded_config_only_target, shards, out, 24) == 0

    tensors = load_file(out)
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    vocab_size = json.loads((padded_config_only_target / "config.json").read_text())["vocab_size"]
    assert d2t.dtype == torch.int64 and d2t.shape == (24,)
    assert t2d.dtype == torch.bool and t2d.shape == (vocab_size,) and int(t2d.sum()) == 24
    draft_ids = torch.arange(24) + d2t
    assert torch.all(draft_ids[1:] > draft_ids[:-1])
    assert torch.equal(torch.nonzero(t2d).flatten(), draft_ids)

    # independent count over the shards' masked tokens (eval.parquet is not counted)
    counts = Counter()
    for shard in shards:
        for row in pq.read_table(shard).to_pylist():
            counts.update(t for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
    want_d2t, want_t2d = build_vocab_mappings_from_distribution(dict(counts), 24, vocab_size)
    assert torch.equal(d2t, want_d2t) and torch.equal(t2d, want_t2d)
    stats = json.loads(out.with_suffix(".json").read_text())
    covered = sum(n for t, n in counts.items() if t2d[t])
    assert stats["coverage"] == pytest.approx(covered / sum(counts.values()))
    assert len(counts) > 24 and 0 < stats["coverage"] < 1  # the cut drops rare tokens
    assert stats["assistant_tokens"] == sum(counts.values())
    assert stats["distinct_assistant_tokens"] == len(counts)
    assert stats["provenance"]["settings"] == {"vocab": {"draft_vocab_size": 24}}
    assert sorted(p.name for p in out.parent.iterdir()) == ["vocab.json", "vocab.safetensors"]

    capsys.readouterr()
    assert (
        vocab_cli(
            padded_config_only_target, shards, tmp_path / "v2" / "vocab.safetensors", vocab_size + 1
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        f"eyrie vocab: error: vocab.draft_vocab_size={vocab_size + 1} is larger "
        f"than the target vocabulary ({vocab_size} in "
    )
    assert not (tmp_path / "v2" / "vocab.safetensors").exists()

"""FP8 hidden-state storage against bfloat16 on the demo target: the same
workflow run twice, changing only `extract.storage_dtype`, and compared on the evaluation's
acceptance length, the trained draft's final loss and accuracies, and the shards' bytes.
Goal: AL changes by at most 2% at half the bytes.

    .venv/bin/python benchmarks/storage_al.py

Each run is `snakemake -c 2 --configfile <config.yaml with target.name al_<dtype> and that
storage_dtype>` from the repository root (results under results/al_<dtype>/; a run that is
already complete is not redone). Prints a table and writes benchmarks/results/storage_al-cpu.json.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DTYPES = ("bfloat16", "float8_e4m3")


def config_for(dtype: str, folder: Path) -> Path:
    text = (REPO / "config" / "config.yaml").read_text()
    text, n1 = re.subn(r"(?m)^  name: demo$", f"  name: al_{dtype}", text)
    text, n2 = re.subn(r"(?m)^  storage_dtype: \S+", f"  storage_dtype: {dtype}", text)
    if (n1, n2) != (1, 1):
        raise SystemExit(
            "config/config.yaml: expected one `  name: demo` and one `  storage_dtype:` line"
        )
    path = folder / f"al_{dtype}.yaml"
    path.write_text(text)
    return path


def main() -> None:
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in DTYPES:
            cfg = config_for(dtype, Path(tmp))
            t0 = time.perf_counter()
            proc = subprocess.run(
                [str(REPO / ".venv" / "bin" / "snakemake"), "-c", "2", "--configfile", str(cfg)],
                cwd=REPO,
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                sys.exit(f"snakemake failed for {dtype}:\n{proc.stderr[-3000:]}")
            res = REPO / "results" / f"al_{dtype}"
            ev = json.loads((res / "eval" / "eval.json").read_text())
            tr = json.loads((res / "train" / "train.json").read_text())
            shards = sorted((res / "hidden").glob("shard_*.h5"))
            rows[dtype] = {
                "acceptance_length": ev["trained"]["acceptance_length"],
                "per_position_acceptance": ev["trained"]["per_position_acceptance"],
                "num_drafts": ev["trained"]["num_drafts"],
                "outputs_match_target_greedy": ev["outputs_match_target_greedy"],
                "untrained_acceptance_length": ev["untrained"]["acceptance_length"],
                "final_loss": tr["final"]["loss"],
                "final_full_acc": tr["final"]["full_acc"],
                "shard_bytes": sum(p.stat().st_size for p in shards),
                "shards": len(shards),
                "snakemake_s": round(time.perf_counter() - t0, 1),
            }
    b, f = rows["bfloat16"], rows["float8_e4m3"]
    change = f["acceptance_length"] / b["acceptance_length"] - 1
    bytes_ratio = f["shard_bytes"] / b["shard_bytes"]
    print(f"\nstorage_dtype on the demo target ({date.today()}), same workflow otherwise")
    print(f"{'storage':12} {'AL':>7} {'per position':>22} {'final loss':>10} {'shard bytes':>12}")
    for d, r in rows.items():
        pos = " ".join(f"{x:.3f}" for x in r["per_position_acceptance"])
        al, loss, size = r["acceptance_length"], r["final_loss"], r["shard_bytes"]
        print(f"{d:12} {al:>7.4f} {pos:>22} {loss:>10.4f} {size:>12}")
    print(
        f"float8_e4m3 vs bfloat16: AL {100 * change:+.2f}% (goal within 2%),"
        f" bytes {bytes_ratio:.3f}x"
    )
    out = REPO / "benchmarks" / "results" / "storage_al-cpu.json"
    out.write_text(
        json.dumps(
            {
                "date": str(date.today()),
                "command": "python benchmarks/storage_al.py",
                "rows": rows,
                "al_change": change,
                "bytes_ratio": bytes_ratio,
                "goal": {"al_change_max": 0.02, "bytes_ratio": 0.5},
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""What stands for a user's target folder in the DAG: two small fingerprint files, rewritten
only when what they describe changed.

A target is hundreds of GB; Snakemake would compare the weights by mtime only, and tracking only
config.json missed weights replaced in place. At parse time `track_target` describes each
tracked file by its size and a digest: the whole file when small, and for a large one its
safetensors header and samples of its tensors (about 1 MiB read per file, not GBs). A file
whose size, mtime, ctime and inode match the last description is not read again.
`weights.json` (config, weights, remote code) and `tokenizer.json` (config, tokenizer files,
remote code) are rewritten only when their digest changed, so their mtime moves exactly when
their content did: the rules take them as inputs. Standard library only: the Snakefile imports
this at every parse.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from pathlib import Path

from eyrie.arch.target import TOKENIZER_FILES
from eyrie.core.errors import TargetError

FORMAT = 1
# Each group: the file name patterns (top level of the target folder) whose content it tracks.
GROUPS = {
    "weights": (
        "config.json",
        "generation_config.json",
        "*.safetensors",
        "*.safetensors.index.json",
        "*.bin",
        "*.bin.index.json",
        "*.py",
    ),
    "tokenizer": (
        "config.json",
        *TOKENIZER_FILES,
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "*.tiktoken",
        "chat_template.json",
        "*.py",
    ),
}
WHOLE_FILE_BYTES = 16 << 20  # files up to this size are hashed whole
SAMPLE_TENSORS = 256  # a larger one: its header, the middle of this many of its tensors
SAMPLE_BLOCKS = 16  # and this many blocks evenly over its data
SAMPLE_BYTES = 4 << 10
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


def safetensors_header(path: Path) -> tuple[int, dict]:
    """The header length and header of a safetensors file; ValueError saying what is wrong."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes: too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{size} bytes, but its header claims {n:,} header bytes")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"its header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return n, header


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is cut short or corrupt (None when its length matches its header)."""
    try:
        n, header = safetensors_header(path)
        ends = [t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        return f"{path}: not a readable safetensors file ({exc})"
    size, expected = path.stat().st_size, 8 + n + max(ends, default=0)
    if size != expected:
        cut = "truncated" if size < expected else "longer than its tensors"
        return f"{path}: {size:,} bytes, but its header says {expected:,} ({cut})"
    return None


def _sample_offsets(path: Path, size: int) -> tuple[bytes, list[int]]:
    """What to hash of a large file besides its size: the safetensors header, and where to read
    SAMPLE_BYTES: the middle of up to SAMPLE_TENSORS tensors (spread over the file, so a change
    of whole tensors, as a fine-tune or a merged adapter makes, is seen) and SAMPLE_BLOCKS
    blocks evenly over the data."""
    start, head, offsets = 0, b"", []
    if path.suffix == ".safetensors":
        try:
            n, header = safetensors_header(path)
            head, start = json.dumps(header, sort_keys=True).encode(), 8 + n
            spans = sorted(t["data_offsets"] for k, t in header.items() if k != "__metadata__")
            step = max(len(spans) // SAMPLE_TENSORS, 1)
            for a, b in spans[::step]:
                offsets.append(start + max((a + b - SAMPLE_BYTES) // 2, a))
        except (ValueError, KeyError, TypeError):
            pass  # sampled like any file; preflight names the problem
    span = max(size - start - SAMPLE_BYTES, 0)
    offsets += [start + span * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)]
    return head, offsets


def file_digest(path: Path, size: int) -> str:
    """sha256 of a small file; of a large one's size, safetensors header and sampled bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            return "sha256:" + h.hexdigest()
        head, offsets = _sample_offsets(path, size)
        h.update(str(size).encode() + b"\0" + head)
        for offset in offsets:
            f.seek(offset)
            h.update(f.read(SAMPLE_BYTES))
    return "sampled:" + h.hexdigest()


def tracked_files(target: Path, patterns: tuple[str, ...]) -> list[Path]:
    """The regular files at the top of `target` that match one of `patterns`, by name."""
    names = sorted(p.name for p in target.iterdir() if p.is_file())
    return [target / n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]


def _describe(files: list[Path], known: dict) -> dict:
    out = {}
    for path in files:
        st = path.stat()
        # ctime and inode too: a replacement given the old mtime (cp -p, rsync -t) differs there
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        seen = known.get(path.name) or {}
        digest = seen["digest"] if seen.get("stat") == stamp else file_digest(path, st.st_size)
        out[path.name] = {"size": st.st_size, "stat": stamp, "digest": digest}
    return out


def _group_digest(files: dict) -> str:
    content = {name: (d["size"], d["digest"]) for name, d in files.items()}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _read(path: Path) -> dict:
    try:
        got = json.loads(path.read_text())
        return got if isinstance(got, dict) and got.get("format") == FORMAT else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, record: dict, keep_mtime_ns: int | None) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    if keep_mtime_ns is not None:  # same content: the rules must not see it as changed
        os.utime(tmp, ns=(keep_mtime_ns, keep_mtime_ns))
    os.replace(tmp, path)


def track_target(target: str | Path, out_dir: str | Path) -> dict[str, str]:
    """Write out_dir/<group>.json for each group of GROUPS; their paths, by group, and under
    "given" the target.path the current content was first given as.

    A file is rewritten only when its group's digest changed (its mtime then moves), or with its
    old mtime kept when only the files' mtimes did (so the next parse reads nothing again).
    """
    target, out_dir = Path(target), Path(out_dir)
    if not target.is_dir():
        raise TargetError(
            f"target.path {target}: not a folder; set it to a Hugging Face model folder "
            "(config.json, safetensors weights, tokenizer)"
        )
    if not (target / "config.json").is_file():
        raise TargetError(
            f"target.path {target}: no config.json; set it to a Hugging Face model folder"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    paths, records = {}, {}
    for group, patterns in GROUPS.items():
        old = _read(out_dir / f"{group}.json")
        files = _describe(tracked_files(target, patterns), old.get("files") or {})
        records[group] = (
            old,
            {
                "format": FORMAT,
                "target": str(target.resolve()),
                "group": group,
                "digest": _group_digest(files),
                "files": files,
            },
        )
    # target.path as given when this content was first seen: the rules compare it (their
    # params, eyrie.config.rules.ComparedAs), so a symlink or a copy of the same folder reruns
    # nothing
    same = all(old.get("digest") == new["digest"] for old, new in records.values())
    given = records["weights"][0].get("given") if same else None
    for group, (old, record) in records.items():
        path = out_dir / f"{group}.json"
        record["given"] = given or str(target)
        files = record["files"]
        if record != old:
            if old.get("digest") == record["digest"] and path.is_file():
                keep = path.stat().st_mtime_ns  # same content: not changed for the rules
            elif not old and files:  # first written: as old as what it describes, so that
                keep = max(os.stat(target / n).st_mtime_ns for n in files)  # outputs made
            else:  # since stay current (an upgrade from an eyrie without these files)
                keep = None
            _write(path, record, keep)
        paths[group] = str(path)
    paths["given"] = given or str(target)
    return paths


def content_digest(target: str | Path) -> str:
    """One digest of every tracked file of `target`, read now (preflight records it)."""
    patterns = tuple(dict.fromkeys(p for group in GROUPS.values() for p in group))
    return _group_digest(_describe(tracked_files(Path(target), patterns), {}))


def demo_weights_changed(folder: str | Path) -> str | None:
    """Why the demo target's weights are not the ones build_demo_target wrote (the digest it
    recorded in demo_training.json), or None. The workflow tracks the demo target by its
    config files only: weights replaced by hand would rerun nothing."""
    folder = Path(folder)
    weights, summary = folder / "model.safetensors", folder / "demo_training.json"
    try:
        recorded = json.loads(summary.read_text()).get("weights_digest")
        size = weights.stat().st_size
    except (OSError, ValueError, AttributeError):
        return None  # not built yet, or by an eyrie that recorded no digest
    if recorded is None or file_digest(weights, size) == recorded:
        return None
    return (
        f"{weights} is not the file build_demo_target wrote (its content changed), and nothing "
        "reruns for it; rebuild it with snakemake --forcerun build_demo_target, or give your "
        "own model folder as target.path"
    )

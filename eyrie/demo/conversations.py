"""Demo conversations generated from the Python standard library's docstrings.

Every machine has this text, so the demo needs no network. A user asks about a stdlib object
through a handful of templates; the assistant answers with the cleaned first paragraph of its
docstring in one consistent style; some conversations carry a system message, some have
follow-up turns (module, kind, signature, a sibling object). The structure is real and
learnable, which is what a draft model needs to learn to predict the target.

Output: one `{"messages": [...]}` per line (OpenAI form, docs/contracts.md), deterministic for a
given seed and Python version, written atomically with a provenance file beside it.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path

from eyrie.config.stages import DemoConversationsSettings
from eyrie.core.errors import ConversationsError
from eyrie.core.io import atomic_path, provenance, write_json
from eyrie.demo.corpus import read_conversations

log = logging.getLogger(__name__)

# Pure-Python (or stable C-backed) standard-library modules, in a FIXED sorted order. Modules
# that fail to import on this machine are skipped (and listed in the provenance file).
MODULES = sorted(
    [
        "argparse",
        "base64",
        "bisect",
        "calendar",
        "collections",
        "contextlib",
        "copy",
        "csv",
        "dataclasses",
        "datetime",
        "decimal",
        "difflib",
        "email.utils",
        "enum",
        "fnmatch",
        "fractions",
        "ftplib",
        "functools",
        "getopt",
        "gettext",
        "glob",
        "gzip",
        "hashlib",
        "heapq",
        "hmac",
        "html",
        "http.cookies",
        "inspect",
        "ipaddress",
        "itertools",
        "json",
        "logging",
        "mimetypes",
        "netrc",
        "numbers",
        "operator",
        "os.path",
        "pathlib",
        "pprint",
        "queue",
        "quopri",
        "random",
        "re",
        "secrets",
        "shlex",
        "shutil",
        "statistics",
        "string",
        "tarfile",
        "tempfile",
        "textwrap",
        "threading",
        "tokenize",
        "typing",
        "urllib.parse",
        "uuid",
        "wave",
        "weakref",
        "zipfile",
    ]
)

MAX_ANSWER_CHARS = 320
MIN_ANSWER_CHARS = 20
MAX_SIGNATURE_CHARS = 120

SYSTEM_PROMPTS = [
    "You are a concise assistant that explains the Python standard library.",
    "You answer questions about Python's standard library in one short paragraph.",
    "You are a helpful Python expert. Keep answers brief and precise.",
]
QUESTIONS = [
    "What does `{name}` do?",
    "Explain `{name}` briefly.",
    "What is `{name}` for?",
    "Can you describe `{name}`?",
    "In one or two sentences, what does `{name}` do?",
    "Tell me about `{name}` from the Python standard library.",
    "I found `{name}` in some code. What is it?",
    "Summarize the documentation of `{name}`.",
]
MODULE_QUESTIONS = [
    "Which module is it in?",
    "Where is it defined?",
    "What module does it come from?",
]
KIND_QUESTIONS = ["Is it a function or a class?", "What kind of object is it?"]
SIGNATURE_QUESTIONS = [
    "What is its signature?",
    "How do I call it?",
    "What arguments does it take?",
]
SIBLING_QUESTIONS = [
    "And `{name}`?",
    "What about `{name}`?",
    "How about `{name}` from the same module?",
]


@dataclass(frozen=True)
class DocEntry:
    """One documented stdlib object."""

    name: str  # dotted display name, e.g. "json.dumps" or "pathlib.Path.read_text"
    module: str  # import name, e.g. "os.path"
    kind: str  # "function" | "class" | "method of `X`"
    summary: str  # cleaned first docstring paragraph
    signature: str | None  # "(obj, *, skipkeys=False, ...)" when short enough, else None


# ----------------------------------------------------------------------------- docstring harvest

_SIGNATURE_LINE = re.compile(r"^[A-Za-z_][\w.]*\(.*\)(\s*(->|-->).*)?$", re.S)


def clean_summary(doc: str | None) -> str | None:
    """First prose paragraph of a docstring, whitespace-collapsed and cut to a sentence end.

    Leading signature paragraphs of C-implemented objects ("reduce(function, ...) -> value")
    are skipped. Returns None when nothing usable is left.
    """
    if not doc or not isinstance(doc, str):
        return None
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", inspect.cleandoc(doc)) if p.strip()]
    while paragraphs and _SIGNATURE_LINE.match(" ".join(paragraphs[0].split())):
        paragraphs.pop(0)
    if not paragraphs:
        return None
    text = " ".join(paragraphs[0].split())
    text = re.sub(r"``([^`]+)``", r"`\1`", text)  # reST literals -> Markdown code
    if ">>>" in text or len(text) < MIN_ANSWER_CHARS:
        return None
    if len(text) > MAX_ANSWER_CHARS:
        cut = text[:MAX_ANSWER_CHARS]
        end = cut.rfind(". ")
        text = (
            cut[: end + 1]
            if end >= MIN_ANSWER_CHARS
            else cut[: cut.rfind(" ")].rstrip(",;:") + " ..."
        )
    if not text.endswith((".", "...", "?", "!", ")", ":")):
        text += "."
    return text


def _signature(obj) -> str | None:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None
    sig = " ".join(sig.split())
    if len(sig) > MAX_SIGNATURE_CHARS or " at 0x" in sig:  # addresses are not deterministic
        return None
    return sig


def _public_names(module) -> list[str]:
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return sorted(n for n in exported if isinstance(n, str) and not n.startswith("_"))
    own = {module.__name__}
    return sorted(
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", None) in own
    )


def harvest(modules: list[str] = MODULES) -> tuple[list[DocEntry], list[str]]:
    """Documented public functions, classes and methods of `modules`; also the modules skipped."""
    entries: dict[str, DocEntry] = {}
    skipped = []
    for mod_name in modules:
        try:
            module = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - a stdlib module missing on this build is skipped
            skipped.append(mod_name)
            continue
        for attr in _public_names(module):
            obj = getattr(module, attr, None)
            if not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            if getattr(obj, "__module__", None) == "builtins":  # aliases such as typing.Text = str
                continue
            name = f"{mod_name}.{attr}"
            kind = "class" if inspect.isclass(obj) else "function"
            summary = clean_summary(getattr(obj, "__doc__", None))
            if summary and name not in entries:
                entries[name] = DocEntry(name, mod_name, kind, summary, _signature(obj))
            if not inspect.isclass(obj):
                continue
            for meth_name, raw in sorted(vars(obj).items()):  # own definitions only
                if meth_name.startswith("_"):
                    continue
                meth = getattr(obj, meth_name, None)
                if not inspect.isroutine(meth) and not isinstance(raw, (staticmethod, classmethod)):
                    continue
                summary = clean_summary(getattr(meth, "__doc__", None))
                full = f"{name}.{meth_name}"
                if summary and full not in entries:
                    entries[full] = DocEntry(
                        full, mod_name, f"method of `{name}`", summary, _signature(meth)
                    )
    return [entries[k] for k in sorted(entries)], skipped


# ----------------------------------------------------------------------------- conversations


def _answer(entry: DocEntry) -> str:
    return f"`{entry.name}`: {entry.summary}"


def _follow_up(
    entry: DocEntry, siblings: list[DocEntry], rng: random.Random
) -> tuple[list[dict], DocEntry]:
    """One follow-up (user, assistant) pair about `entry`, and the subject of the next one."""
    options = ["module", "kind", "sibling"]
    if entry.signature is not None:
        options.append("signature")
    choice = rng.choice(options)
    others = [s for s in siblings if s.name != entry.name]
    if choice == "sibling" and not others:
        choice = "module"
    subject = entry
    if choice == "module":
        q, a = rng.choice(MODULE_QUESTIONS), f"It is defined in the `{entry.module}` module."
    elif choice == "kind":
        article = "an" if entry.kind[0] in "aeiou" else "a"
        q, a = rng.choice(KIND_QUESTIONS), f"`{entry.name}` is {article} {entry.kind}."
    elif choice == "signature":
        q, a = rng.choice(SIGNATURE_QUESTIONS), f"Call it as `{entry.name}{entry.signature}`."
    else:
        subject = rng.choice(others)
        q, a = rng.choice(SIBLING_QUESTIONS).format(name=subject.name), _answer(subject)
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}], subject


def make_conversations(entries: list[DocEntry], num: int, seed: int) -> list[dict]:
    """`num` conversations cycling through a seeded shuffle of `entries`.

    About 1/3 carry a system message; about 40% have one or two follow-up turns.
    """
    if not entries:
        raise ConversationsError(
            "no documented stdlib objects found; is the Python standard library complete?"
        )
    rng = random.Random(seed)
    order = list(entries)
    by_module: dict[str, list[DocEntry]] = {}
    for e in entries:
        by_module.setdefault(e.module, []).append(e)
    conversations = []
    for i in range(num):
        if i % len(order) == 0:
            rng.shuffle(order)
        entry = order[i % len(order)]
        messages = []
        if rng.random() < 1 / 3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        messages.append({"role": "user", "content": rng.choice(QUESTIONS).format(name=entry.name)})
        messages.append({"role": "assistant", "content": _answer(entry)})
        r = rng.random()
        subject = entry
        for _ in range(2 if r < 0.1 else 1 if r < 0.4 else 0):
            turn, subject = _follow_up(subject, by_module[subject.module], rng)
            messages.extend(turn)
        conversations.append({"messages": messages})
    return conversations


# ----------------------------------------------------------------------------- CLI


def write_conversations(out: str | Path, settings: dict) -> dict:
    """Generate and atomically write the conversations; return stats (also in the provenance)."""
    cfg = DemoConversationsSettings.from_settings(settings)
    entries, skipped = harvest()
    conversations = make_conversations(entries, cfg.num_conversations, cfg.seed)
    out = Path(out)
    with atomic_path(out) as tmp:
        with tmp.open("w", encoding="utf-8") as f:
            for conv in conversations:
                f.write(json.dumps(conv, ensure_ascii=False) + "\n")
        read_conversations(tmp)  # validate what was written before it becomes visible
    stats = {
        "num_conversations": len(conversations),
        "num_documented_objects": len(entries),
        "num_modules": len({e.module for e in entries}),
        "skipped_modules": skipped,
        "with_system": sum(c["messages"][0]["role"] == "system" for c in conversations),
        "multi_turn": sum(
            sum(m["role"] == "assistant" for m in c["messages"]) > 1 for c in conversations
        ),
    }
    write_json(
        out.with_name(out.stem + ".provenance.json"), {**stats, "provenance": provenance(settings)}
    )
    log.info(
        "wrote %d conversations about %d stdlib objects (%d multi-turn, %d with a system "
        "message) to %s",
        stats["num_conversations"],
        stats["num_documented_objects"],
        stats["multi_turn"],
        stats["with_system"],
        out,
    )
    return stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="conversations.jsonl to write")


def run(args: argparse.Namespace) -> int:
    write_conversations(args.out, args.settings)
    return 0

"""The last lines of a failed run: one line per failed job, with eyrie's error from its log.

Snakemake reports a failed job in 25-70 lines that end in "check log file(s)"; the cause, the
line `eyrie <stage>` printed, is in the rule's log. The Snakefile's `onerror:` handler calls
`report_failures`, so the run ends with, for each failed job, its rule, that line and the log.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from eyrie.core.io import last_good_path

# What eyrie.cli prints: "eyrie <stage>: error: ..." (an EyrieError, an OSError the user fixes)
# or, in a logging line, "eyrie <stage>: unexpected <Type>: ..." (a bug: its traceback follows).
ERROR_LINE = re.compile(r"eyrie [a-z-]+: (?:error|unexpected \w+): .*")
# What bash or sh print when a command cannot start (a missing vllm.python, a script without +x).
SHELL_ERROR = re.compile(
    r"^(?:/bin/)?(?:ba)?sh: .*(?:No such file or directory|command not found|Permission denied)$"
)
TAIL_BYTES = 256 * 1024  # the error is printed last; a traceback after it fits many times over


def error_line(log: str | Path) -> str | None:
    """eyrie's error in `log` as one line: the first error line, its first detail line (an
    error listing several problems has one per line) and how many more there are; None if the
    log holds no eyrie error (the job was killed, or Snakemake failed it: its message says)."""
    lines = _tail(log, TAIL_BYTES) or []
    for i, line in enumerate(lines):
        found = ERROR_LINE.search(line)
        if not found:
            continue
        text = found.group(0).rstrip()
        if ": unexpected " in text:
            return text
        details = []
        for more in lines[i + 1 :]:
            if not more.startswith("  "):
                break
            details.append(more.strip())
        if details:
            text += f" {details[0]}"
        if len(details) > 1:
            text += f" (+{len(details) - 1} more in the log)"
        return text
    return None


def _tail(log: str | Path, size: int) -> list[str] | None:
    """The lines of the last `size` bytes of `log`; None when it cannot be read."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - size))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None


def last_line(log: str | Path, limit: int = 300) -> str | None:
    """The last non-empty line of `log` (at most `limit` characters), or None."""
    lines = [line.strip() for line in _tail(log, 4096) or [] if line.strip()]
    return lines[-1][:limit] if lines else None


def failure_lines(jobs: Iterable[tuple[str, list[str]]]) -> list[str]:
    """One line per failed job, given as (rule, its log files): the rule, eyrie's error and the
    log; a job whose logs hold no eyrie error says so and points at Snakemake's message."""
    out = []
    for rule, logs, *outputs in jobs:
        kept = last_good(outputs[0] if outputs else [])
        found = [(log, line) for log in logs if (line := error_line(log))]
        if found:
            out += [f"failed rule {rule}: {line} (log: {log}){kept}" for log, line in found]
        elif logs:
            missing = [log for log in logs if not Path(log).is_file()]
            ends = [line for log in logs if (line := last_line(log))]
            if ends and SHELL_ERROR.search(ends[-1]):  # the command never started
                out.append(
                    f"failed rule {rule}: the shell could not run its command: {ends[-1]} "
                    f"(log: {', '.join(logs)}); fix the path it names{kept}"
                )
                continue
            what = f"{', '.join(missing)} not written" if missing else "no eyrie error in it"
            what += f" (it ends: {ends[-1]})" if ends else ""
            out.append(
                f"failed rule {rule}: {what} (log: {', '.join(logs)}); Snakemake's message "
                f"above says why (e.g. killed, out of memory or time, outputs missing){kept}"
            )
        else:
            out.append(f"failed rule {rule}: no log; Snakemake's message above says why{kept}")
    return out


def last_good(outputs: list[str]) -> str:
    """ "; the last good X: PATH" for each output the failed job's rerun took away (Snakemake
    deletes a job's outputs before it runs) whose last good copy eyrie kept (io.keep_last_good)."""
    kept = []
    for output in outputs:
        path, copy = Path(output), last_good_path(output)
        if not path.exists() and copy.is_file():
            kept.append(f"; the last good {path.name} is kept as {copy}")
    return "".join(kept)


def failed_jobs(workflow) -> list[tuple[str, list[str]]]:
    """(rule, log files) of the jobs Snakemake's scheduler gave up on, retries done; a failed
    group (an extraction engine with its shard jobs) as those of its jobs whose logs hold an
    eyrie error, or all of them when none does."""
    out = []
    for job in workflow.scheduler.failed:
        members = sorted(job.jobs, key=str) if job.is_group() else [job]
        entries = [
            (m.rule.name, [str(f) for f in m.log], [str(f) for f in m.output]) for m in members
        ]
        with_error = [e for e in entries if any(error_line(f) for f in e[1])]
        out += [e for e in with_error or entries if e not in out]
    return sorted(out, key=lambda e: (e[1], e[0]))


def report_failures(workflow, stream: TextIO = sys.stderr) -> None:
    """Print `failure_lines` of the workflow's failed jobs: the Snakefile's onerror handler.
    Never raises: a traceback here would bury the lines it exists to show."""
    try:
        lines = failure_lines(failed_jobs(workflow))
    except Exception as exc:  # noqa: BLE001 - Snakemake's own report above still stands
        lines = [f"eyrie: the failed jobs could not be listed ({type(exc).__name__}: {exc})"]
    for line in lines:
        print(line, file=stream)

"""Why a benchmark's child failed, in one line: the cause, not only its exit status.

A failed child (a vLLM engine, `eyrie train`, a Snakemake run) prints hundreds of lines, and the
last of them are often a wrapper: vLLM's "Engine core initialization failed. See root cause
above", torchrun's ChildFailedError, Snakemake's "At least one job did not complete
successfully". `cause(text)` finds the line that says why (an exception, CUDA out of memory, a
kill, eyrie's own `eyrie <stage>: error: ...`), skipping those wrappers; `failed(...)` is the row
a benchmark records: {"error": "exit N", "cause": ..., "tail": ...}. `snakemake_failures` names
each failed job of a Snakemake run with the cause read from its log.

Benchmarks import it as `import failure` with benchmarks/ on sys.path (they run as scripts).
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eyrie.core.failures import ERROR_LINE  # noqa: E402  (eyrie's own one-line errors)

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Prefixes in front of a message, taken off one after another: vLLM's process tag
# "(EngineCore pid=123) ", torchrun's "[rank0]: ", vLLM's logger "ERROR 12-06 10:00:00
# [core.py:1165] " and Python logging as eyrie.cli formats it ("2026-01-01 10:00:00,000 eyrie.cli
# ERROR "). A logger line below ERROR is never the cause (a warning names a fallback, not a fault).
PREFIX = re.compile(
    r"^(?:\([^()]* pid=\d+\) ?"
    r"|\[rank\d+\]: ?"
    r"|(?P<vllm>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ?"
    r"|\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.]\d+ \S+ (?P<py>DEBUG|INFO|WARNING|ERROR|CRITICAL) ?)"
)
QUIET = {"DEBUG", "INFO", "WARNING"}
# A line that says why: an exception at the line's start ("torch.OutOfMemoryError: ..."), CUDA
# out of memory in any form, a kill (bash's "1234 Killed", torchrun's "Signal 9 (SIGKILL)
# received by PID"), a crash, or the one-line summaries of eyrie and of the Snakefile's onerror.
# Snakemake's own: "MissingInputException in rule all in file "Snakefile", line 1:", then the text.
EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception)(?::.*| in (?:rule|file) .*:)?$")
OTHER = re.compile(
    r"CUDA out of memory|CUDA error: out of memory"
    r"|^Killed$|\d+ Killed\b|Signal \d+ \(SIG\w+\) received by PID"
    r"|^Fatal Python error: |\b(?:Segmentation fault|Bus error)\b"
    r"|^KeyboardInterrupt\b|^failed rule \w+: "
)
# Lines that only point elsewhere ("see above"): a cause only when nothing else is found.
WRAPPER = re.compile(
    r"Engine core initialization failed|See root cause above|for the root cause"
    r"|died unexpectedly|^Process \S+ died|died with exit code"
    r"|At least one job did not complete successfully|ChildFailedError"
    r"|^Error in (?:rule|group) "
)
# A child's negative exit code in a wrapper: vLLM's "Failed core proc(s): {'EngineCore': -9}",
# "Process EngineCore (PID: 12) died with exit code -9".
SIGNALLED = re.compile(r"(?:exit code |': )(-\d+)\b")
SNAKEMAKE_JOB = re.compile(r"^Error in rule (\w+):")
SNAKEMAKE_LOG = re.compile(r"^\s*log: (.+?) \(check log file\(s\) for error details\)$")
LIMIT = 600  # characters of a cause kept: torch's OOM line is ~560


def message(line: str) -> str | None:
    """`line` without colour codes and the prefixes in PREFIX; None for a logger line below
    ERROR."""
    line = ANSI.sub("", line).rstrip()
    while found := PREFIX.match(line):
        if (found["vllm"] or found["py"]) in QUIET:
            return None
        line = line[found.end() :]
    return line


def cause(text: str) -> str | None:
    """The line of `text` (a child's stdout and stderr, or a log) that says why it failed, with
    its prefixes taken off: the last error line that is not a wrapper (so the root cause a vLLM
    engine printed before its client's "See root cause above"), else the last wrapper (a
    negative exit code in it named as a signal), else None."""
    lines = [message(line) for line in text.splitlines()]
    found, wrappers = None, []
    for i, line in enumerate(lines):
        if not line:
            continue
        wrapper = WRAPPER.search(line)
        if not (wrapper or EXCEPTION.match(line) or OTHER.search(line) or ERROR_LINE.search(line)):
            continue
        if EXCEPTION.match(line) and line.endswith(":"):  # "WorkflowError:", then its message
            line += " " + next((x.strip() for x in lines[i + 1 :] if x and x.strip()), "")
        if wrapper or WRAPPER.search(line):
            wrappers.append(line)
        else:
            found = line
    if found is None and wrappers:
        found = SIGNALLED.sub(lambda m: f"{m[0]} ({signal_name(-int(m[1]))})", wrappers[-1])
    return found.strip()[:LIMIT] if found else None


def signal_name(number: int) -> str:
    """SIGKILL for 9, with the usual reason for it; `signal N` for a number Python doesn't name."""
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    return f"{name}, often the kernel's OOM killer" if number == signal.SIGKILL else name


def exit_status(returncode: int) -> str:
    """The status as "exit N"; for a child a signal ended (a negative return code, or a
    shell's 128 + N) also the signal's name."""
    if returncode < 0:
        return f"exit {returncode} (killed by {signal_name(-returncode)})"
    if 128 < returncode < 128 + 65:
        number = returncode - 128
        killed = f"a shell's child killed by {signal_name(number)}"
        return f"exit {returncode} (128 + {number}: {killed})"
    return f"exit {returncode}"


def failed(returncode: int | None, text: str, tail: int = 4000, error: str | None = None) -> dict:
    """The record of a failed child: {"error": its exit status (or `error`, e.g. a timeout),
    "cause": its cause line (None where it printed none), "tail": the last `tail` characters}."""
    return {
        "error": error or exit_status(returncode),
        "cause": cause(text),
        "tail": text[-tail:],
    }


def why(row: dict) -> str:
    """A failed row in one table cell: its exit status and its cause."""
    error, found = row.get("error", "not run"), row.get("cause")
    return f"{error}: {found}" if found else error


def snakemake_failures(output: str, workdir: Path) -> list[dict]:
    """Each failed job of a Snakemake run: {"rule", "log", "cause"}, from the "Error in rule
    NAME:" blocks of its `output` and the log files each names (relative to `workdir`); the
    cause is the log's cause line, or what the log lacks. A run that failed before any job
    (a bad config, a missing input) gives one entry with rule None and Snakemake's own cause."""
    jobs: list[tuple[str, str]] = []
    rule = None
    for line in output.splitlines():
        if found := SNAKEMAKE_JOB.match(line.strip()):
            rule = found[1]
        elif (found := SNAKEMAKE_LOG.match(line)) and rule:
            jobs += [(rule, log) for log in found[1].split(", ") if (rule, log) not in jobs]
    if not jobs:
        return [{"rule": None, "log": None, "cause": cause(output)}]
    out = []
    for rule, log in jobs:
        path = workdir / log
        if not path.is_file():
            out.append({"rule": rule, "log": log, "cause": "log not written"})
            continue
        text = path.read_text(errors="replace")
        ends = [x.strip() for x in text.splitlines() if x.strip()]
        said = cause(text) or (f"no error line; it ends: {ends[-1][:LIMIT]}" if ends else "empty")
        out.append({"rule": rule, "log": log, "cause": said})
    return out


def snakemake_message(output: str, workdir: Path) -> str:
    """`snakemake_failures` as lines: "rule NAME: CAUSE (log: PATH)"."""
    return "\n".join(
        f"rule {f['rule']}: {f['cause']} (log: {f['log']})" if f["rule"] else str(f["cause"])
        for f in snakemake_failures(output, workdir)
    )

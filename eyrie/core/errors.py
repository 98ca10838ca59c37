"""Every user-facing error type, one per stage or part that raises it.

An EyrieError's message names the file, record or key at fault and the fix, in one line (a line
per problem when there are several); `eyrie <stage>` prints it without a traceback and exits 2.
Any other exception is a bug or an environment failure: logged with its traceback (exit 1).
"""

import errno
import os


class EyrieError(Exception):
    """A user-facing error: its message names the file/key at fault and the fix."""


class ConfigError(EyrieError):
    """A config section that fails the schema (eyrie.config.schema)."""


class TargetError(EyrieError):
    """The target folder, its architecture or the layer ids asked of it (eyrie.arch)."""


class VllmAdapterError(EyrieError):
    """The vLLM side of an architecture: no adapter, or one that does not fit this vLLM."""


class EngineError(EyrieError):
    """The extraction engine: its socket and the requests sent to it (eyrie.extract)."""


class ExtractError(EyrieError):
    """Hidden-state extraction, including a tokenized shard it cannot use."""


class ShardError(EyrieError):
    """A hidden-state shard (HDF5) that cannot be written or read (eyrie.formats.hidden)."""


class ExportError(EyrieError):
    """The exported draft: writing it or reading it back (eyrie.formats.draft)."""


class PreflightError(EyrieError):
    """A preflight check that failed, or a preflight report missing, failed or stale."""


class DataError(EyrieError):
    """Conversation files and settings of the tokenize stage (eyrie.data)."""


class VocabError(EyrieError):
    """The draft vocabulary map: building it or reading it back."""


class EvaluateError(EyrieError):
    """The evaluation stages, including an eval set they cannot use."""


class ConversationsError(EyrieError):
    """The demo conversations file is missing or malformed (eyrie.demo)."""


class DemoError(EyrieError):
    """The embedded demo's settings, and the target it builds and trains (eyrie.demo)."""


def os_error_of(exc: BaseException) -> tuple[int | None, object, str | None]:
    """(errno, filename, strerror) of an OSError, or of safetensors' SafetensorError, which
    carries the errno in its message only ("... (os error 28)"); (None, None, None) otherwise."""
    import re

    if isinstance(exc, OSError):
        return exc.errno, exc.filename, exc.strerror
    found = re.search(r"\(os error (\d+)\)", str(exc))
    if type(exc).__name__ == "SafetensorError" and found:
        return int(found[1]), None, None
    return None, None, None


# OSErrors of the file system the user fixes (not bugs): errno -> the fix.
PERMISSIONS = "fix its permissions or owner (chmod/chown), or use a path you may read and write"
OS_FIXES = {
    errno.ENOSPC: "free space on that disk, or run the workflow where there is room (snakemake -d)",
    errno.EDQUOT: "free space within your disk quota, or run the workflow on another file system",
    errno.EROFS: "run the workflow in a writable folder (snakemake -d DIR)",
    errno.EACCES: PERMISSIONS,
    errno.EPERM: PERMISSIONS,
}
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def free_space(path: str | os.PathLike) -> str | None:
    """ "<size> free there" for the disk holding `path` (its folder when it is no folder
    itself); None where that folder does not exist."""
    import shutil

    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if free >= size:
            return f"{free / size:.1f} {unit} free there"
    return f"{free} bytes free there"


def os_error_text(
    exc: BaseException, path: str, where: str | os.PathLike | None = None
) -> str | None:
    """One line for an OSError the user fixes (OS_FIXES): `path` as the line names it, what
    happened, for a full disk the free space of the one holding `where` (a path; none given,
    none said), and the fix; None for any other exception."""
    number, _, what = os_error_of(exc)
    if number not in OS_FIXES:
        return None
    free = free_space(where) if number in DISK_FULL and where is not None else None
    return (
        f"{path}: {what or os.strerror(number)}{f' ({free})' if free else ''}; {OS_FIXES[number]}"
    )

"""Every user-facing error type, one per stage or part that raises it.

An EyrieError's message names the file, record or key at fault and the fix, in one line (a line
per problem when there are several); `eyrie <stage>` prints it without a traceback and exits 2.
Any other exception is a bug or an environment failure: logged with its traceback (exit 1).
"""


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

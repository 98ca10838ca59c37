"""Every user-facing error type: its message names the file or key at fault and the fix."""


class EyrieError(Exception):
    """A user-facing error: its message names the file/key at fault and the fix."""


class ConfigError(EyrieError):
    pass


class TargetError(EyrieError):
    pass


class VllmAdapterError(EyrieError):
    pass


class EngineError(EyrieError):
    pass


class ExtractError(EyrieError):
    pass


class ShardError(EyrieError):
    pass


class ExportError(EyrieError):
    pass


class PreflightError(EyrieError):
    pass


class DataError(EyrieError):
    pass


class VocabError(EyrieError):
    pass


class EvaluateError(EyrieError):
    pass

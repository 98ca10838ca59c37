"""eyrie: train EAGLE-3 speculative-decoding drafts, from chat data to a vLLM-loadable draft."""

__version__ = "0.1.0"


class EyrieError(Exception):
    """A user-facing error: its message names the file/key at fault and the fix."""

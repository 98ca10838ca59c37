"""eyrie: train EAGLE-3 speculative-decoding drafts, from chat data to a vLLM-loadable draft.

One subpackage per workflow stage, library modules beside them: docs/layout.md.
"""

__version__ = "0.1.0"

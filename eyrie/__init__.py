"""eyrie: train EAGLE-3 speculative-decoding drafts, from chat data to a vLLM-loadable draft."""

__version__ = "0.1.0"

"""The kinds of draft eyrie trains, named as vLLM's `speculative_config.method`, and the config
field that names the target layers each reads. Imports nothing: the training, the export, the
formats and the vLLM evaluation (in the vLLM environment) read the same names.
"""

from __future__ import annotations

# the draft kinds, named as vLLM's speculative_config.method: EAGLE-3 (one token per draft
# forward, K forwards) and the block drafters (a block of tokens per forward)
DRAFT_METHODS = ("eagle3", "dflash", "dspark")
BLOCK_METHODS = ("dflash", "dspark")


def aux_key(method: str | None) -> str:
    """The config field naming the target layers a draft of `method` reads: EAGLE-3's own name,
    or the block drafters'."""
    if method in BLOCK_METHODS:
        return "aux_hidden_state_layer_ids"
    return "eagle_aux_hidden_state_layer_ids"

"""The block proposer of the Hugging Face evaluation (eyrie.evaluate.specdec.BlockProposer)
drafts what the draft was trained to draft: its block's logits at the latest token equal those
of speculators' own training forward at that anchor (DSpark's with the Markov bias of the same
previous tokens), and it decodes real prompts to the target's own output."""

from __future__ import annotations

import pytest
import torch

from eyrie.evaluate.specdec import BlockProposer, Decoding, SpecStats, speculative_generate
from eyrie.formats.report import shard_expectation
from eyrie.train.packing import PackedShards
from tests.support.train_helpers import AUX_IDS, BLOCK, block_draft


def one_sample(world) -> dict:
    data = PackedShards(world["shards"], shard_expectation(world["preflight"]), 512, gap=0)
    try:
        batch = data.batch([0])
    finally:
        data.close()
    n = int((batch["document_ids"][0] >= 0).sum())
    return {k: v[:, :n] for k, v in batch.items()}


def training_blocks(draft, batch: dict) -> tuple[list[int], torch.Tensor]:
    """Every position of the sample as an anchor in speculators' training forward (dense sdpa
    masks: the context before the anchor, the whole block): (anchors, logits [anchors, B, V]),
    DSpark's with its Markov bias from the block's true tokens, as its forward adds it."""
    n = batch["input_ids"].shape[1]
    with torch.no_grad():
        hidden, logits, _, _, index = draft._backbone_forward(**batch, max_anchors=n)
        logits = logits.view(n, BLOCK, -1)
        head = getattr(draft, "markov_head", None)
        if head is not None:
            tokens = batch["input_ids"][0, index].view(n, BLOCK)
            prev = (
                tokens
                if draft.config.sample_from_anchor
                else torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)
            )
            logits = logits + head.block_bias(
                prev_token_ids=prev, hidden_states=hidden.view(n, BLOCK, -1)
            )
    starts = index[::BLOCK].tolist()[: n - BLOCK]  # the valid anchors first, then padding
    assert starts == list(range(n - BLOCK))  # every position but the last block's
    return starts, logits


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_the_proposers_block_is_the_training_forwards_block(world, method):
    """At each anchor, the proposer given the tokens up to it and the target states before it
    gives the training forward's block logits (each slot's Markov bias from the same previous
    tokens: the block's true ones)."""
    torch.manual_seed(0)
    draft = block_draft(world, method).eval()
    batch = one_sample(world)
    n = batch["input_ids"].shape[1]
    batch["loss_mask"] = torch.ones_like(batch["loss_mask"])
    batch["position_ids"] = torch.arange(n)[None]
    starts, logits = training_blocks(draft, batch)
    proposer = BlockProposer(draft)
    assert proposer.K == BLOCK - proposer.first == BLOCK - (method == "dflash")
    ids, aux = batch["input_ids"][0], batch["hidden_states"][0]
    with torch.no_grad():
        for a in starts[:: max(1, len(starts) // 12)]:
            hidden, base = proposer.backbone(ids[: a + 1], aux[:a])
            truth = ids[a : a + BLOCK].tolist()  # the latest token, then the true continuation
            # slot_logits reads only the tokens before its slot: the whole truth serves all
            mine = torch.stack([proposer.slot_logits(hidden, base, truth, j) for j in range(BLOCK)])
            torch.testing.assert_close(mine, logits[a], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_the_proposer_decodes_a_prompt_as_the_target_does(world, method):
    """Greedy speculative decoding with the block proposer: the output is the target's own
    greedy output (verification keeps it exact), and vLLM's counters count K = B - 1 drafts."""
    from eyrie.evaluate.specdec import greedy_generate

    proposer = BlockProposer(block_draft(world, method))
    target = world["model"]
    prompt = one_sample(world)["input_ids"][0, :20].tolist()
    K = proposer.K
    decoding = Decoding(K=K, max_new_tokens=24, eos_id=None, aux_ids=list(AUX_IDS))
    stats = SpecStats(K=K)
    out = speculative_generate(target, prompt, proposer, decoding, stats)
    assert out == greedy_generate(target, prompt, 24, None)
    assert stats.num_drafts > 0 and stats.num_draft_tokens == stats.num_drafts * K

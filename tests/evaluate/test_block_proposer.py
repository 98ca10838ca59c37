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


def one_sample(world) -> tuple[dict, dict]:
    """The first sample as training packs it for a block drafter, and as the shard stores it
    (what decoding has: token t's states at position t)."""
    data = PackedShards(
        world["shards"], shard_expectation(world["preflight"]), 512, gap=0, shifted=False
    )
    try:
        batch = data.batch([0])
        r_i, s_i = data.refs[0]
        stored = data.readers[r_i].read(s_i)
        stored = {k: torch.as_tensor(v) for k, v in stored.items()}
    finally:
        data.close()
    n = int((batch["document_ids"][0] >= 0).sum())
    return {k: v[:, :n] for k, v in batch.items()}, stored


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
    """At each anchor, the proposer given what decoding has there — the stored tokens up to the
    latest one and the target states of the tokens before it, at their positions — gives the
    training forward's block logits on the training pack (each slot's Markov bias from the same
    previous tokens: the block's true ones). So training packs a block drafter's sample as
    decoding meets it: EAGLE-3's shifted alignment would feed the block the token after the
    latest one (and fails here)."""
    torch.manual_seed(0)
    draft = block_draft(world, method).eval()
    batch, stored = one_sample(world)
    n = batch["input_ids"].shape[1]
    assert torch.equal(batch["position_ids"][0], torch.arange(n))
    batch["loss_mask"] = torch.ones_like(batch["loss_mask"])  # every position an anchor
    starts, logits = training_blocks(draft, batch)
    proposer = BlockProposer(draft)
    assert proposer.K == BLOCK - proposer.first == BLOCK - (method == "dflash")
    ids, aux = stored["input_ids"], stored["aux_hidden"].float()
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
    prompt = one_sample(world)[1]["input_ids"][:20].tolist()
    K = proposer.K
    decoding = Decoding(K=K, max_new_tokens=24, eos_id=None, aux_ids=list(AUX_IDS))
    stats = SpecStats(K=K)
    out = speculative_generate(target, prompt, proposer, decoding, stats)
    assert out == greedy_generate(target, prompt, 24, None)
    assert stats.num_drafts > 0 and stats.num_draft_tokens == stats.num_drafts * K

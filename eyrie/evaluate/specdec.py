"""Greedy speculative decoding with a pluggable proposer; acceptance length (AL) as vLLM defines it.

Per prompt the target prefills the context; a proposer drafts K tokens; the target verifies them
in one forward pass; the longest prefix equal to the target's greedy tokens is accepted, plus the
target's own next (bonus) token. The EAGLE-3 proposer runs the draft the way vLLM does at inference
(chain drafting on the verified target states), reusing speculators' Eagle3DraftModel submodules;
the block proposer drafts a DFlash or DSpark block in one draft forward, as their training
forward runs a block.
Metrics are vLLM's: AL = 1 + accepted_tokens / num_drafts, counted per verification before the
output is cut at EOS / max_new_tokens (as vLLM's scheduler counts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from eyrie.arch.hooks import capture_hidden_states
from eyrie.config.drafts import block_positions
from eyrie.core.errors import EvaluateError

# propose(token_ids [T+1] int64, aux_states [T, A*H] float, k) -> k target token ids.
# token_ids is the context plus the target's latest (not yet verified-upon) token;
# aux_states[t] are the target's aux hidden states (concatenated) of token_ids[t].
Proposer = Callable[[torch.Tensor, torch.Tensor, int], list[int]]

# eval.temperature > 0: prompt n is decoded by every run from a generator seeded SAMPLE_SEED + n
# (the drafts compared draw from the same stream: a paired comparison); vLLM's sampled run
# seeds prompt n's request so too (its own generator: the same seeds, not the same draws)
SAMPLE_SEED = 0


@dataclass
class SpecStats:
    """vLLM's speculative-decoding counters (vllm:spec_decode_*)."""

    K: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_at_position = self.accepted_at_position or [0] * self.K

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.accepted_tokens += num_accepted
        for k in range(num_accepted):
            self.accepted_at_position[k] += 1

    def metrics(self) -> dict:
        n = self.num_drafts
        return {
            "acceptance_length": 1 + self.accepted_tokens / n if n else None,
            "per_position_acceptance": [a / n for a in self.accepted_at_position] if n else None,
            "num_drafts": n,
            "num_draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_at_position": list(self.accepted_at_position),
        }


@torch.no_grad()
def target_logits(
    target, ids: torch.Tensor, aux_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One full forward of the target over `ids` [L] int64: logits [L, V] (of the next token
    after each position) and aux [L, A*H] (the aux hidden states of each position, concatenated
    in `aux_ids` order)."""
    with capture_hidden_states(target, aux_ids) as states:
        logits = target(input_ids=ids[None], use_cache=False).logits[0]  # [L, V]
    aux = torch.cat([states[i][0] for i in aux_ids], dim=-1)  # [L, A*H]
    return logits, aux


def target_step(target, ids: torch.Tensor, aux_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits with greedy [L] int64 (the argmax next token after each position) for the
    logits."""
    logits, aux = target_logits(target, ids, aux_ids)
    return logits.argmax(dim=-1), aux


def _finished(out: list[int], max_new_tokens: int, eos_id: int | None) -> bool:
    return len(out) >= max_new_tokens or (eos_id is not None and eos_id in out)


def _cut(out: list[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    if eos_id is not None and eos_id in out:
        out = out[: out.index(eos_id) + 1]
    return out[:max_new_tokens]


@torch.no_grad()
def greedy_generate(
    target, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None
) -> list[int]:
    """Plain greedy decoding (full recompute each token): the reference output."""
    device = next(target.parameters()).device
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)  # [L]
    out: list[int] = []
    while not _finished(out, max_new_tokens, eos_id):
        logits = target(input_ids=ids[None], use_cache=False).logits[0, -1]  # [V]
        out.append(int(logits.argmax()))
        ids = torch.cat([ids, ids.new_tensor(out[-1:])])
    return out


@dataclass(frozen=True)
class Decoding:
    """How each prompt is decoded: K drafted tokens per verification, at most max_new_tokens new
    tokens, a stop at eos_id (None: none); the target layers whose states the proposer reads."""

    K: int
    max_new_tokens: int
    eos_id: int | None
    aux_ids: list[int]


@torch.no_grad()
def speculative_generate(
    target,
    prompt_ids: list[int],
    propose: Proposer,
    decoding: Decoding,
    stats: SpecStats | None = None,
) -> list[int]:
    """Greedy speculative decoding; returns the new tokens (cut at EOS / max_new_tokens)."""
    K, aux_ids = decoding.K, decoding.aux_ids
    limits = (decoding.max_new_tokens, decoding.eos_id)
    device = next(target.parameters()).device
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)  # [P]
    greedy, aux = target_step(target, ids, aux_ids)  # [P], [P, A*H]
    out = [int(greedy[-1])]  # prefill gives token 1
    ids = torch.cat([ids, greedy[-1:]])  # [L]; aux covers ids[:-1]
    while not _finished(out, *limits):
        L = len(ids)
        draft = [int(t) for t in propose(ids, aux, K)]
        if len(draft) != K:
            raise EvaluateError(f"proposer returned {len(draft)} tokens, expected K={K}")
        seq = torch.cat([ids, ids.new_tensor(draft)])  # [L + K]
        greedy, aux_all = target_step(target, seq, aux_ids)  # [L + K], [L + K, A*H]
        verify = greedy[L - 1 :].tolist()  # [K + 1]: target after ids[-1], d_1..d_K
        n = 0
        while n < K and draft[n] == verify[n]:
            n += 1
        if stats is not None:
            stats.observe(K, n)
        new = draft[:n] + [verify[n]]  # accepted prefix + bonus token
        out += new
        ids = torch.cat([ids, ids.new_tensor(new)])  # [L + n + 1]
        aux = aux_all[: L + n]  # states of ids[:-1], verified
    return _cut(out, *limits)


def verify_sampled(
    p: torch.Tensor, q: list[torch.Tensor], draft: list[int], generator: torch.Generator
) -> tuple[int, int]:
    """Speculative sampling's verification (Leviathan et al. 2023; Chen et al. 2023): p [K+1, V]
    the target's distributions after the context and after each drafted token, q[j] the one
    drafted token j was drawn from. Token j is accepted with probability min(1, p_j(x) /
    q_j(x)); the first rejected is replaced by a draw from max(p_j - q_j, 0), renormalised; with
    every token accepted the next comes from p_K. The tokens so emitted follow the target's own
    distribution at any draft. Returns (accepted, the token emitted after them)."""
    for j, x in enumerate(draft):
        u = torch.rand((), generator=generator, dtype=torch.float64)
        if u * q[j][x] < p[j, x]:  # u < p/q, without dividing by a q of 0
            continue
        residual = (p[j] - q[j]).clamp(min=0)
        total = residual.sum()
        if total <= 0:  # p == q: a rejection has probability 0; float rounding only
            residual, total = p[j], p[j].sum()
        token = torch.multinomial(residual / total, 1, generator=generator)
        return j, int(token)
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))


@torch.no_grad()
def speculative_sample(
    target,
    prompt_ids: list[int],
    propose,
    decoding: Decoding,
    temperature: float,
    generator: torch.Generator,
    stats: SpecStats | None = None,
) -> list[int]:
    """Speculative decoding by sampling at `temperature` (target and draft alike): the draft
    samples each of its K tokens (SamplePick), the target verifies them (verify_sampled). The
    output is a sample of the target's own distribution; returns the new tokens."""
    K, aux_ids = decoding.K, decoding.aux_ids
    limits = (decoding.max_new_tokens, decoding.eos_id)
    device = next(target.parameters()).device

    def dist(logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.double() / temperature, dim=-1).cpu()

    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)  # [P]
    logits, aux = target_logits(target, ids, aux_ids)
    first = int(torch.multinomial(dist(logits[-1]), 1, generator=generator))
    out = [first]
    ids = torch.cat([ids, ids.new_tensor([first])])  # [L]; aux covers ids[:-1]
    while not _finished(out, *limits):
        L = len(ids)
        pick = SamplePick(temperature, logits.shape[-1], generator)
        draft = [int(t) for t in propose(ids, aux, K, pick=pick)]
        seq = torch.cat([ids, ids.new_tensor(draft)])  # [L + K]
        logits, aux_all = target_logits(target, seq, aux_ids)  # [L + K, V]
        n, extra = verify_sampled(dist(logits[L - 1 :]), pick.q, draft, generator)
        if stats is not None:
            stats.observe(K, n)
        new = draft[:n] + [extra]
        out += new
        ids = torch.cat([ids, ids.new_tensor(new)])  # [L + n + 1]
        aux = aux_all[: L + n]  # states of ids[:-1], verified
    return _cut(out, *limits)


def _eval_mode(draft, masks: str, fix: str):
    """`draft` in eval mode, refused unless its attention takes what a proposer passes (`masks`:
    dense masks or none; flex attention needs block masks), the line ending with `fix`."""
    impl = draft.config.transformer_layer_config._attn_implementation
    if impl not in ("sdpa", "eager"):
        raise ValueError(f"draft attention {impl!r}: the proposer passes {masks}; {fix}")
    return draft.eval()


def to_target(draft, draft_ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocab ids -> target ids (target_id = i + d2t[i]; no d2t: the same vocabulary)."""
    d2t = draft.d2t
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


def greedy_pick(draft, logits: torch.Tensor) -> torch.Tensor:
    """A proposer's token from its draft-vocab logits [Vd]: the argmax, as a target id."""
    return to_target(draft, logits.argmax())


class SamplePick:
    """A proposer's token sampled from its draft-vocab logits at `temperature`, as a target id;
    each draw's distribution over the target vocabulary is kept in `q` (zero outside the draft's
    vocabulary) for the verification (speculative_sample)."""

    def __init__(self, temperature: float, vocab_size: int, generator: torch.Generator):
        self.temperature, self.vocab_size, self.generator = temperature, vocab_size, generator
        self.q: list[torch.Tensor] = []

    def __call__(self, draft, logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.double() / self.temperature, dim=-1).cpu()  # [Vd]
        drafted = torch.multinomial(probs, 1, generator=self.generator)[0]
        ids = to_target(draft, torch.arange(len(probs), device=logits.device)).cpu()
        q = torch.zeros(self.vocab_size, dtype=torch.float64).index_add_(0, ids, probs)
        self.q.append(q)
        return to_target(draft, drafted.to(logits.device))


class Eagle3Proposer:
    """EAGLE-3 chain drafting as vLLM runs it, on an Eagle3DraftModel's own submodules.

    Step 0 runs the context pairs (x_{t+1}, g_t), g_t = fc(aux states of token t), at positions
    t+1 (speculators' shift_batch alignment) and drafts from the last one. Each further step
    appends one position holding (embedding of the token just drafted, the decoder's output state
    at the previous position), position id + 1, as in Eagle3DraftModel.forward's TTT loop.
    The draft is recomputed over the whole sequence each step with a plain causal mask.
    """

    def __init__(self, draft):
        self.draft = _eval_mode(
            draft,
            "dense causal masks",
            "load the draft with eyrie.evaluate.inputs.load_draft (sdpa)",
        )

    def fuse(self, aux_states: torch.Tensor) -> torch.Tensor:
        """aux_states [T, A*H] -> g [T, H]: (input_norm | fc_norm) and fc, as in forward."""
        d = self.draft
        x = aux_states
        if d.input_norm is not None:
            x = d.input_norm(x)
        if d.fc_norm is not None:
            chunks = x.chunk(len(d.fc_norm), dim=-1)
            x = torch.cat([norm(c) for norm, c in zip(d.fc_norm, chunks, strict=True)], dim=-1)
        return d.fc(x)

    def decode(
        self, token_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """token_ids [S] int64 (target ids), hidden [S, H], position_ids [S] -> out [S, H]."""
        d = self.draft
        S = len(token_ids)
        x = torch.cat([d.embed_tokens(token_ids), hidden], dim=-1)[None]  # [1, S, 2H]
        pos = position_ids[None]  # [1, S]
        mask = torch.full((S, S), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        mask = mask[None, None]  # [1, 1, S, S] causal
        rope = d.rotary_emb(x, pos)
        for layer in d.layers:
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        return x[0]  # [S, H] pre-norm

    def head(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """out [..., H] -> (logits [..., draft_vocab], state carried to the next step [..., H])."""
        d = self.draft
        if d.config.norm_output:
            out = d.norm(out)
            return d.lm_head(out), out
        return d.lm_head(d.norm(out)), out

    @torch.no_grad()
    def __call__(
        self, token_ids: torch.Tensor, aux_states: torch.Tensor, k: int, pick=greedy_pick
    ) -> list[int]:
        # token_ids: [T+1] int64; aux_states: [T, A*H]
        T = aux_states.shape[0]
        ids = token_ids[1:]  # [T]: x_{t+1} pairs with g_t
        hidden = self.fuse(aux_states.to(self.draft.fc.weight.dtype))  # [T, H]
        pos = torch.arange(1, T + 1, device=ids.device)  # [T]
        drafted = []
        for _ in range(k):
            logits, carried = self.head(self.decode(ids, hidden, pos)[-1])  # [Vd], [H]
            token = pick(self.draft, logits)  # [] int64 target id
            drafted.append(int(token))
            ids = torch.cat([ids, token[None]])
            hidden = torch.cat([hidden, carried[None]])
            pos = torch.cat([pos, pos[-1:] + 1])
        return drafted


class BlockProposer:
    """Block drafting (DFlash, DSpark), one block per verification, on the draft's own
    submodules, as its training forward runs a block at an anchor: the block [latest token, mask
    token x (B - 1)] at positions T..T+B-1 attends to hidden_norm(fc(aux states)) of every
    context position t < T and to the whole block (bidirectional). DFlash drafts slots 1..B-1
    (its anchor slot is the bonus token); a draft that samples from its anchor (DSpark) drafts
    slots 0..B-1. A Markov head (DSpark) adds to slot j's logits a bias from the token before
    it (the latest token, then each drafted one in turn), so those slots are drafted in order.
    At K below the block's tokens the block is cut to the slots K needs, as vLLM runs it."""

    def __init__(self, draft):
        self.draft = _eval_mode(
            draft, "no block mask", "load the draft with sdpa or eager attention"
        )
        self.first = 0 if draft.config.sample_from_anchor else 1
        self.K = self.positions(draft)
        self.markov = getattr(draft, "markov_head", None)

    @staticmethod
    def positions(draft) -> int:
        """The tokens one block proposes: every slot, or all but the anchor's."""
        c = draft.config
        return block_positions(c.speculators_model_type, c.block_size, c.sample_from_anchor)

    def backbone(
        self, token_ids: torch.Tensor, aux_states: torch.Tensor, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids [T+1], aux_states [T, A*H] -> the block's (normed states [B, H], logits
        [B, draft_vocab]) before any Markov bias; B is `length` (default the trained block)."""
        d = self.draft
        T, B = aux_states.shape[0], length or d.block_size
        context = d.hidden_norm(d.fc(aux_states.to(d.fc.weight.dtype)))[None]  # [1, T, H]
        block = token_ids.new_full((B,), d.mask_token_id)
        block[0] = token_ids[-1]
        x = d.embed_tokens(block)[None]  # [1, B, H]
        pos = torch.arange(T + B, device=token_ids.device)[None]  # context, then the block
        rope = d.rotary_emb(context, pos)
        for layer in d.layers:  # no mask: every context position and the whole block
            x = layer(
                hidden_states=x,
                target_hidden=context,
                attention_mask=None,
                position_ids=pos,
                use_cache=False,
                position_embeddings=rope,
            )
        hidden = d.norm(x)[0]
        return hidden, d.lm_head(hidden)

    def slot_logits(
        self, hidden: torch.Tensor, logits: torch.Tensor, before: list[int], slot: int
    ) -> torch.Tensor:
        """Slot `slot`'s logits given the target ids before it in the block (`before`: the
        latest token, then the drafted ones): plus the Markov head's bias where there is one."""
        if self.markov is None:
            return logits[slot]
        prev = before if self.first == 0 else before[:1] + before  # slot k conditions on k-1
        prev_ids = torch.tensor(prev[: slot + 1], device=logits.device)[None]  # the rest unread
        bias = self.markov.block_bias(
            prev_token_ids=prev_ids, hidden_states=hidden[None, : slot + 1]
        )
        return logits[slot] + bias[0, -1].to(logits.dtype)

    @torch.no_grad()
    def __call__(
        self, token_ids: torch.Tensor, aux_states: torch.Tensor, k: int, pick=greedy_pick
    ) -> list[int]:
        if not 1 <= k <= self.K:
            raise EvaluateError(f"this block drafter drafts up to {self.K} tokens, asked for {k}")
        # as vLLM drafts K tokens: a block of the anchor's slot and K more (DFlash), or of K slots
        # when the anchor's drafts too; never padded to the trained block_size
        hidden, logits = self.backbone(token_ids, aux_states, self.first + k)
        before = [int(token_ids[-1])]
        for slot in range(self.first, self.first + k):
            before.append(int(pick(self.draft, self.slot_logits(hidden, logits, before, slot))))
        return before[1:]

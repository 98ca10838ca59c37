"""Acceptance length of a draft by real greedy speculative decoding with a Hugging Face target.

Per prompt the target prefills the context; a proposer drafts K tokens; the target verifies them
in one forward pass; the longest prefix equal to the target's greedy tokens is accepted, plus the
target's own next (bonus) token. The EAGLE-3 proposer runs the draft the way vLLM does at inference
(chain drafting on the verified target states), reusing speculators' Eagle3DraftModel submodules.
Metrics are vLLM's: AL = 1 + accepted_tokens / num_drafts, counted per verification before the
output is cut at EOS / max_new_tokens (as vLLM's scheduler counts them). Every speculative output
is checked token for token against plain greedy decoding of the target.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from eyrie import EyrieError
from eyrie.capture import capture_hidden_states
from eyrie.io import atomic_path, provenance, write_json

log = logging.getLogger(__name__)

UNTRAINED_SEED = 0
DEVICES = ("auto", "cpu", "cuda")

# propose(token_ids [T+1] int64, aux_states [T, A*H] float, k) -> k target token ids.
# token_ids is the context plus the target's latest (not yet verified-upon) token;
# aux_states[t] are the target's aux hidden states (concatenated) of token_ids[t].
Proposer = Callable[[torch.Tensor, torch.Tensor, int], list[int]]


class EvaluateError(EyrieError):
    pass


# ----------------------------------------------------------------------------- metrics


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


# ----------------------------------------------------------------------------- decoding


@torch.no_grad()
def target_step(target, ids: torch.Tensor, aux_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One full forward of the target over `ids` [L] int64.

    Returns greedy [L] int64 (the argmax next token after each position) and
    aux [L, A*H] (the aux hidden states of each position, concatenated in `aux_ids` order).
    """
    with capture_hidden_states(target, aux_ids) as states:
        logits = target(input_ids=ids[None], use_cache=False).logits[0]  # [L, V]
    aux = torch.cat([states[i][0] for i in aux_ids], dim=-1)  # [L, A*H]
    return logits.argmax(dim=-1), aux


def _finished(out: list[int], max_new_tokens: int, eos_id: int | None) -> bool:
    return len(out) >= max_new_tokens or (eos_id is not None and eos_id in out)


def _cut(out: list[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    if eos_id is not None and eos_id in out:
        out = out[: out.index(eos_id) + 1]
    return out[:max_new_tokens]


@torch.no_grad()
def greedy_generate(target, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    """Plain greedy decoding (full recompute each token): the reference output."""
    device = next(target.parameters()).device
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)  # [L]
    out: list[int] = []
    while not _finished(out, max_new_tokens, eos_id):
        logits = target(input_ids=ids[None], use_cache=False).logits[0, -1]  # [V]
        out.append(int(logits.argmax()))
        ids = torch.cat([ids, ids.new_tensor(out[-1:])])
    return out


@torch.no_grad()
def speculative_generate(target, prompt_ids: list[int], propose: Proposer, K: int,
                         max_new_tokens: int, eos_id: int | None, *, aux_ids: list[int],
                         stats: SpecStats | None = None) -> list[int]:
    """Greedy speculative decoding; returns the new tokens (cut at EOS / max_new_tokens)."""
    device = next(target.parameters()).device
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)  # [P]
    greedy, aux = target_step(target, ids, aux_ids)                  # [P], [P, A*H]
    out = [int(greedy[-1])]                                          # prefill gives token 1
    ids = torch.cat([ids, greedy[-1:]])                              # [L]; aux covers ids[:-1]
    while not _finished(out, max_new_tokens, eos_id):
        L = len(ids)
        draft = [int(t) for t in propose(ids, aux, K)]
        if len(draft) != K:
            raise EvaluateError(f"proposer returned {len(draft)} tokens, expected K={K}")
        seq = torch.cat([ids, ids.new_tensor(draft)])                # [L + K]
        greedy, aux_all = target_step(target, seq, aux_ids)          # [L + K], [L + K, A*H]
        verify = greedy[L - 1:].tolist()                             # [K + 1]: target after ids[-1], d_1..d_K
        n = 0
        while n < K and draft[n] == verify[n]:
            n += 1
        if stats is not None:
            stats.observe(K, n)
        new = draft[:n] + [verify[n]]                                # accepted prefix + bonus token
        out += new
        ids = torch.cat([ids, ids.new_tensor(new)])                  # [L + n + 1]
        aux = aux_all[: L + n]                                       # states of ids[:-1], verified
    return _cut(out, max_new_tokens, eos_id)


class Eagle3Proposer:
    """EAGLE-3 chain drafting as vLLM runs it, on an Eagle3DraftModel's own submodules.

    Step 0 runs the context pairs (x_{t+1}, g_t), g_t = fc(aux states of token t), at positions
    t+1 (speculators' shift_batch alignment) and drafts from the last one. Each further step
    appends one position holding (embedding of the token just drafted, the decoder's output state
    at the previous position), position id + 1, as in Eagle3DraftModel.forward's TTT loop.
    The draft is recomputed over the whole sequence each step with a plain causal mask.
    """

    def __init__(self, draft):
        impl = draft.config.transformer_layer_config._attn_implementation
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"draft attention {impl!r}: the proposer passes dense causal masks; "
                             "load the draft with eyrie.evaluate.load_draft (sdpa)")
        self.draft = draft.eval()

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

    def decode(self, token_ids: torch.Tensor, hidden: torch.Tensor,
               position_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [S] int64 (target ids), hidden [S, H], position_ids [S] -> out [S, H]."""
        d = self.draft
        S = len(token_ids)
        x = torch.cat([d.embed_tokens(token_ids), hidden], dim=-1)[None]  # [1, S, 2H]
        pos = position_ids[None]                                          # [1, S]
        mask = torch.full((S, S), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        mask = mask[None, None]                                           # [1, 1, S, S] causal
        rope = d.rotary_emb(x, pos)
        for layer in d.layers:
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        return x[0]                                                       # [S, H] pre-norm

    def head(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """out [..., H] -> (logits [..., draft_vocab], state carried to the next step [..., H])."""
        d = self.draft
        if d.config.norm_output:
            out = d.norm(out)
            return d.lm_head(out), out
        return d.lm_head(d.norm(out)), out

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids (target_id = i + d2t[i])."""
        d2t = self.draft.d2t
        return draft_ids if d2t is None else draft_ids + d2t[draft_ids]

    @torch.no_grad()
    def __call__(self, token_ids: torch.Tensor, aux_states: torch.Tensor, k: int) -> list[int]:
        # token_ids: [T+1] int64; aux_states: [T, A*H]
        T = aux_states.shape[0]
        ids = token_ids[1:]                               # [T]: x_{t+1} pairs with g_t
        hidden = self.fuse(aux_states.to(self.draft.fc.weight.dtype))  # [T, H]
        pos = torch.arange(1, T + 1, device=ids.device)   # [T]
        drafted = []
        for _ in range(k):
            logits, carried = self.head(self.decode(ids, hidden, pos)[-1])  # [Vd], [H]
            token = self.to_target(logits.argmax())       # [] int64 target id
            drafted.append(int(token))
            ids = torch.cat([ids, token[None]])
            hidden = torch.cat([hidden, carried[None]])
            pos = torch.cat([pos, pos[-1:] + 1])
        return drafted


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class EvalSettings:
    K: int
    max_new_tokens: int
    num_prompts: int
    device: str  # resolved: cpu | cuda


def parse_settings(settings: dict) -> EvalSettings:
    """Check the eval settings (every problem at once, each naming its key); resolve device."""
    ev = settings.get("eval")
    if not isinstance(ev, dict):
        raise EvaluateError("--settings: key 'eval' missing or not an object; pass the config's "
                            "eval section")
    problems = []
    for key in ("num_speculative_tokens", "max_new_tokens", "num_prompts"):
        value = ev.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"eval.{key}={value!r} must be an integer >= 1")
    device = ev.get("device", "auto")
    if device not in DEVICES:
        problems.append(f"eval.device={device!r} must be one of {', '.join(DEVICES)}")
    if problems:
        raise EvaluateError("invalid --settings: " + "; ".join(problems))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise EvaluateError("eval.device=cuda but no CUDA device is visible; set eval.device to "
                            "auto or cpu")
    return EvalSettings(ev["num_speculative_tokens"], ev["max_new_tokens"], ev["num_prompts"], device)


def read_preflight(path: str | Path, fingerprint: str, num_layers: int) -> list[int]:
    """The preflight report's aux_layer_ids, after checking it passed and matches the target."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise EvaluateError(f"{path}: preflight report not found; run `eyrie preflight` first") from None
    except json.JSONDecodeError as exc:
        raise EvaluateError(f"{path}: not valid JSON ({exc}); rerun `eyrie preflight`") from exc
    if not isinstance(report, dict) or report.get("ok") is not True:
        raise EvaluateError(f"{path}: preflight did not pass (ok is not true); rerun `eyrie preflight`")
    have = (report.get("target") or {}).get("fingerprint")
    if have != fingerprint:
        raise EvaluateError(f"{path}: target.fingerprint {have!r} does not match the target's "
                            f"config.json ({fingerprint!r}); rerun `eyrie preflight` for this target")
    aux = report.get("aux_layer_ids")
    if not (isinstance(aux, list) and aux and all(isinstance(i, int) for i in aux)):
        raise EvaluateError(f"{path}: aux_layer_ids must be a non-empty list of integers; "
                            "rerun `eyrie preflight`")
    if any(not 0 <= i < num_layers for i in aux):
        raise EvaluateError(f"{path}: aux_layer_ids {aux} must lie within 0..{num_layers - 1} for "
                            f"a target with {num_layers} layers; rerun `eyrie preflight`")
    if report.get("final_layer_id") != num_layers:
        raise EvaluateError(f"{path}: final_layer_id {report.get('final_layer_id')!r} but the target "
                            f"has {num_layers} layers; rerun `eyrie preflight`")
    return aux


def read_vocab(path: str | Path, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft_vocab], t2d bool [target_vocab]) from vocab.safetensors, cross-checked."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        tensors = load_file(str(path))
    except (FileNotFoundError, SafetensorError, OSError) as exc:
        raise EvaluateError(f"{path}: cannot read the vocabulary map ({exc}); rerun `eyrie vocab`") from exc
    for key in ("d2t", "t2d"):
        if key not in tensors:
            raise EvaluateError(f"{path}: tensor {key!r} missing; rerun `eyrie vocab`")
    d2t, t2d = tensors["d2t"].long(), tensors["t2d"].bool()
    if t2d.shape != (target_vocab,):
        raise EvaluateError(f"{path}: t2d has shape {tuple(t2d.shape)} but the target's vocab_size "
                            f"is {target_vocab}; rebuild the vocabulary map for this target")
    mapped = torch.arange(len(d2t)) + d2t
    if mapped.min() < 0 or mapped.max() >= target_vocab or not torch.equal(
            torch.sort(mapped).values, torch.nonzero(t2d).flatten()):
        raise EvaluateError(f"{path}: d2t and t2d disagree (i + d2t[i] must list exactly the "
                            "tokens t2d marks); rerun `eyrie vocab`")
    return d2t, t2d


def read_prompts(path: str | Path, num_prompts: int, vocab_size: int) -> list[tuple[str, list[int]]]:
    """(sample_id, prompt_ids) of the first `num_prompts` rows of eval.parquet."""
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:
        raise EvaluateError(f"{path}: unreadable parquet ({exc}); rerun `eyrie tokenize`") from exc
    for col in ("sample_id", "prompt_ids"):
        if col not in table.column_names:
            raise EvaluateError(f"{path}: column {col!r} missing; rerun `eyrie tokenize`")
    if table.num_rows < num_prompts:
        log.warning("%s has %d prompts, fewer than eval.num_prompts=%d; using all of them",
                    path, table.num_rows, num_prompts)
    rows = table.slice(0, num_prompts)
    prompts = []
    for sid, ids in zip(rows.column("sample_id").to_pylist(), rows.column("prompt_ids").to_pylist()):
        ids = [int(i) for i in ids or []]
        if not ids:
            raise EvaluateError(f"{path}: sample {sid}: empty prompt_ids; rerun `eyrie tokenize`")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise EvaluateError(f"{path}: sample {sid}: token id outside the target's vocabulary "
                                f"0..{vocab_size - 1}; tokenize with the target's tokenizer")
        prompts.append((str(sid), ids))
    if not prompts:
        raise EvaluateError(f"{path}: no prompts; set data.num_eval >= 1 and rerun `eyrie tokenize`")
    return prompts


def load_draft(path: str | Path):
    """The exported draft through speculators' own loader (sdpa attention: dense masks, any
    device), with its weights checked finite."""
    import warnings

    from eyrie.export import load_draft as load_exported

    path = Path(path)
    if not (path / "config.json").is_file():
        raise EvaluateError(f"{path}/config.json: not found; run `eyrie export` first")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            draft = load_exported(path)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise EvaluateError(f"{path}: speculators cannot load the draft ({first}); re-export it "
                            "(its verifier.name_or_path must point at the target folder)") from exc
    for name, tensor in draft.state_dict().items():
        if name.startswith("verifier_"):
            continue  # training-only weights, unused at inference
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise EvaluateError(f"{path}: draft tensor {name!r} has non-finite values; re-export "
                                "the draft from a finished training run")
    return draft


def check_draft(draft, path, aux_ids: list[int], hidden_size: int, d2t: torch.Tensor,
                t2d: torch.Tensor) -> None:
    """The draft must read the aux layers the preflight chose and use this vocabulary map."""
    draft_aux = list(draft.config.eagle_aux_hidden_state_layer_ids)
    if draft_aux != list(aux_ids):
        raise EvaluateError(f"{path}: draft eagle_aux_hidden_state_layer_ids {draft_aux} differ "
                            f"from the preflight's aux_layer_ids {list(aux_ids)}; retrain/export "
                            "the draft with the preflight's layers (or rerun preflight)")
    if draft.hidden_size != hidden_size:
        raise EvaluateError(f"{path}: draft hidden size {draft.hidden_size} but the target's is "
                            f"{hidden_size}; train the draft for this target")
    if draft.draft_vocab_size != len(d2t):
        raise EvaluateError(f"{path}: draft_vocab_size {draft.draft_vocab_size} but the vocabulary "
                            f"map has {len(d2t)} entries; use the draft trained with this map")
    if draft.d2t is not None and not (torch.equal(draft.d2t.cpu(), d2t)
                                      and torch.equal(draft.t2d.cpu(), t2d)):
        raise EvaluateError(f"{path}: the draft's d2t/t2d differ from the vocabulary map's; use "
                            "the draft trained with this map")


# ----------------------------------------------------------------------------- stage


def plot(path: str | Path, K: int, trained: dict, untrained: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def fmt(m):
        return "n/a" if m["acceptance_length"] is None else f"{m['acceptance_length']:.3f}"

    positions = torch.arange(1, K + 1).tolist()
    width = 0.4
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * K + 2), 3.5))
    for offset, (label, m) in zip((-width / 2, width / 2), (("trained", trained), ("untrained", untrained))):
        values = m["per_position_acceptance"] or [0.0] * K
        ax.bar([p + offset for p in positions], values, width, label=f"{label} (AL {fmt(m)})")
    ax.set_xticks(positions)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"K={K}: AL trained {fmt(trained)} vs untrained {fmt(untrained)}")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
        if tmp.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
            raise EvaluateError(f"{path}: matplotlib did not write a PNG")
    plt.close(fig)


def evaluate(target: str | Path, draft_dir: str | Path, vocab: str | Path, eval_set: str | Path,
             preflight: str | Path, out: str | Path, plot_path: str | Path, settings: dict) -> dict:
    """Run the evaluation and write eval.json and eval.png; returns the report."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eyrie.draft import build_draft
    from eyrie.targets import TargetError, inspect_target

    cfg = parse_settings(settings)
    try:
        info = inspect_target(target)
    except TargetError as exc:
        raise EvaluateError(str(exc)) from exc
    aux_ids = read_preflight(preflight, info.fingerprint, info.num_hidden_layers)
    d2t, t2d = read_vocab(vocab, info.vocab_size)
    prompts = read_prompts(eval_set, cfg.num_prompts, info.vocab_size)
    draft = load_draft(draft_dir)
    check_draft(draft, draft_dir, aux_ids, info.hidden_size, d2t, t2d)
    verifier = draft.config.speculators_config.verifier.name_or_path
    if verifier and Path(verifier).resolve() != Path(target).resolve():
        log.warning("draft's verifier.name_or_path is %s, evaluating against %s", verifier, target)

    max_pos = info.text_config.get("max_position_embeddings")
    longest = max(len(p) for _, p in prompts) + cfg.max_new_tokens + cfg.K
    if isinstance(max_pos, int) and longest > max_pos:
        raise EvaluateError(f"{eval_set}: longest prompt + eval.max_new_tokens + K = {longest} "
                            f"exceeds the target's max_position_embeddings {max_pos}; lower "
                            "eval.max_new_tokens")

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        log.warning("the tokenizer has no eos token: decoding stops at max_new_tokens only")
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    model = model.to(cfg.device).eval()

    tl = draft.config.transformer_layer_config
    untrained = build_draft(target, aux_ids, d2t, t2d, num_layers=tl.num_hidden_layers,
                            draft_arch=tl.model_type,
                            norm_before_residual=draft.config.norm_before_residual,
                            seed=UNTRAINED_SEED)
    proposers = {"trained": Eagle3Proposer(draft.to(cfg.device)),
                 "untrained": Eagle3Proposer(untrained.to(cfg.device))}
    stats = {name: SpecStats(cfg.K) for name in proposers}

    log.info("evaluating %s on %d prompts: K=%d, max_new_tokens=%d, aux ids %s, device %s",
             draft_dir, len(prompts), cfg.K, cfg.max_new_tokens, aux_ids, cfg.device)
    output_tokens = 0
    for n, (sample_id, prompt_ids) in enumerate(prompts, 1):
        reference = greedy_generate(model, prompt_ids, cfg.max_new_tokens, eos_id)
        output_tokens += len(reference)
        for name, propose in proposers.items():
            got = speculative_generate(model, prompt_ids, propose, cfg.K, cfg.max_new_tokens, eos_id,
                                       aux_ids=aux_ids, stats=stats[name])
            if got != reference:
                at = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b),
                          min(len(got), len(reference)))
                raise EvaluateError(
                    f"{eval_set}: prompt {sample_id}: speculative output with the {name} draft "
                    f"differs from the target's greedy output at new token {at} ({len(got)} vs "
                    f"{len(reference)} tokens); speculative decoding must not change greedy outputs")
        log.info("prompt %d/%d (%s): %d prompt + %d new tokens; AL so far trained %.3f, "
                 "untrained %.3f", n, len(prompts), sample_id, len(prompt_ids), len(reference),
                 *(stats[k].metrics()["acceptance_length"] or 1.0 for k in ("trained", "untrained")))

    report = {
        "K": cfg.K,
        "num_prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "output_tokens": output_tokens,
        "trained": stats["trained"].metrics(),
        "untrained": stats["untrained"].metrics(),
        "outputs_match_target_greedy": True,
        "aux_layer_ids": aux_ids,
        "eos_token_id": eos_id,
        "draft": str(draft_dir),
        "target": str(target),
        "untrained_seed": UNTRAINED_SEED,
        "device": cfg.device,
        "provenance": provenance(settings),
    }
    plot(plot_path, cfg.K, report["trained"], report["untrained"])
    write_json(out, report)
    log.info("acceptance length: trained %s, untrained %s -> %s",
             report["trained"]["acceptance_length"], report["untrained"]["acceptance_length"], out)
    return report


def add_arguments(parser) -> None:
    from eyrie.cli import settings_arg

    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--draft", required=True, help="exported draft folder (speculators format)")
    parser.add_argument("--vocab", required=True, help="vocab.safetensors (d2t, t2d)")
    parser.add_argument("--eval-set", required=True, help="eval.parquet with prompt_ids")
    parser.add_argument("--preflight", required=True, help="preflight.json")
    parser.add_argument("--out", required=True, help="eval.json to write")
    parser.add_argument("--plot", required=True, help="eval.png to write")
    parser.add_argument("--settings", required=True, type=settings_arg,
                        help="JSON object with the eval settings")


def run(args) -> int:
    evaluate(args.target, args.draft, args.vocab, args.eval_set, args.preflight, args.out,
             args.plot, args.settings)
    return 0

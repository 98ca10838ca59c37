"""Acceptance length of a draft by real greedy speculative decoding with a Hugging Face target.

The evaluate stage: checks the settings, the preflight report, the vocabulary map, the prompts and
the exported draft (eyrie.evaluate.inputs), then decodes every prompt with the trained draft and
with an untrained baseline (eyrie.evaluate.specdec: EAGLE-3 proposer, vLLM's metrics) and writes
the report JSON, with bootstrap intervals over prompts (eyrie.evaluate.interval), and the plot
(eyrie.evaluate.plot). Every speculative output is checked token for
token against plain greedy decoding of the target.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, replace

import torch

from eyrie.config.stages import EvalSettings
from eyrie.core.errors import EvaluateError
from eyrie.core.io import keep_last_good, provenance, write_json
from eyrie.evaluate.inputs import (
    UNTRAINED_SEED,
    EvalPaths,
    build_proposers,
    check_inputs,
    load_target,
)
from eyrie.evaluate.interval import al_interval, ratio_interval
from eyrie.evaluate.plot import plot
from eyrie.evaluate.specdec import (
    SAMPLE_SEED,
    Decoding,
    SpecStats,
    greedy_generate,
    speculative_generate,
    speculative_sample,
)

log = logging.getLogger(__name__)


@dataclass
class Decoder:
    """The target and the proposers: decodes one prompt greedily and speculatively with each,
    counting into `stats` (one SpecStats per proposer), and with the trained draft again at every
    K' < K, counting into `stats_at_k[K']`.

    Each K' is decoded for real, not derived from the K run: a draft chain's first K' tokens do
    not depend on K, but the positions it drafts from do (at K' the next draft starts after at
    most K' + 1 new tokens), so min(accepted at K, K') per step is not the acceptance at K'.
    """

    model: object
    proposers: dict
    decoding: Decoding
    temperature: float = 0.0  # > 0: speculative sampling, no greedy reference
    stats: dict = field(init=False)
    stats_at_k: dict = field(init=False)
    # in 16 bits: {run label: prompts whose speculative output differed from greedy decoding}
    differs: dict = field(init=False)
    # {run label: [(drafts, accepted tokens) of each prompt]}: the intervals' unit (interval.py)
    per_prompt: dict = field(init=False)

    def __post_init__(self):
        self.differs, self.per_prompt = {}, {}
        self.stats = {name: SpecStats(self.decoding.K) for name in self.proposers}
        self.stats_at_k = {k: SpecStats(k) for k in range(1, self.decoding.K)}

    def runs(self):
        """(label, proposer, decoding, stats) of every speculative run of one prompt."""
        d = self.decoding
        for name, propose in self.proposers.items():
            yield f"{name} draft", propose, d, self.stats[name]
        for k, stats in self.stats_at_k.items():
            yield f"trained draft at K={k}", self.proposers["trained"], replace(d, K=k), stats

    def acceptance_length_by_k(self) -> list:
        """The trained draft's acceptance length at K' = 1..K (index K' - 1)."""
        at = [self.stats_at_k[k] for k in range(1, self.decoding.K)] + [self.stats["trained"]]
        return [s.metrics()["acceptance_length"] for s in at]

    def sample(self, prompt_ids: list[int]) -> list[int]:
        """Every run's speculative sampling of one prompt (the same seed for each); returns the
        trained draft's output."""
        seed = SAMPLE_SEED + len(self.per_prompt.get("trained draft", []))
        outputs = {}
        for name, propose, decoding, stats in self.runs():
            with self._counted(name, stats):
                generator = torch.Generator().manual_seed(seed)
                outputs[name] = speculative_sample(
                    self.model, prompt_ids, propose, decoding, self.temperature, generator, stats
                )
        return outputs["trained draft"]

    @contextlib.contextmanager
    def _counted(self, name: str, stats: SpecStats):
        """One prompt of run `name`: its (drafts, accepted tokens), from what `stats` counted
        meanwhile, appended to per_prompt[name]."""
        before = stats.num_drafts, stats.accepted_tokens
        yield
        self.per_prompt.setdefault(name, []).append(
            (stats.num_drafts - before[0], stats.accepted_tokens - before[1])
        )

    def decode(self, sample_id: str, prompt_ids: list[int], where) -> list[int]:
        """The target's greedy output; each speculative output must equal it in float32 (else
        an error: a bug), and is counted in `differs` where it does not in 16 bits. Sampling
        (temperature > 0): the trained draft's output, checked by nothing but its counts."""
        if self.temperature:
            return self.sample(prompt_ids)
        d = self.decoding
        reference = greedy_generate(self.model, prompt_ids, d.max_new_tokens, d.eos_id)
        for name, propose, decoding, stats in self.runs():
            with self._counted(name, stats):
                got = speculative_generate(self.model, prompt_ids, propose, decoding, stats=stats)
            if got != reference:
                at = next(
                    (i for i, (a, b) in enumerate(zip(got, reference)) if a != b),
                    min(len(got), len(reference)),
                )
                message = (
                    f"{where}: prompt {sample_id}: speculative output with the {name} "
                    f"differs from the target's greedy output at new token {at} ({len(got)} vs "
                    f"{len(reference)} tokens)"
                )
                if self.model.dtype == torch.float32:
                    raise EvaluateError(
                        f"{message}; speculative decoding must not change greedy outputs"
                    )
                # in 16 bits a forward over L + K tokens may round a near tie differently from one
                # over L, as vLLM's may: counted and reported, the acceptance stays well defined
                log.warning(
                    "%s: in %s a near tie can round either way (eval.dtype: float32 tells "
                    "rounding from a bug)",
                    message,
                    str(self.model.dtype).removeprefix("torch."),
                )
                self.differs.setdefault(name, []).append(sample_id)
        return reference


def decode_prompts(decoder: Decoder, prompts: list, where) -> int:
    """Decode every prompt (a log line each); returns the number of output tokens."""
    output_tokens = 0
    for n, (sample_id, prompt_ids) in enumerate(prompts, 1):
        reference = decoder.decode(sample_id, prompt_ids, where)
        output_tokens += len(reference)
        log.info(
            "prompt %d/%d (%s): %d prompt + %d new tokens; AL so far trained %.3f, untrained %.3f",
            n,
            len(prompts),
            sample_id,
            len(prompt_ids),
            len(reference),
            *(
                decoder.stats[k].metrics()["acceptance_length"] or 1.0
                for k in ("trained", "untrained")
            ),
        )
    return output_tokens


def runs(decoder: Decoder) -> dict:
    """The report's figures of one decoding: the trained and the untrained draft's, and the
    first's AL over the second's."""
    per_prompt = decoder.per_prompt
    return {
        "trained": {
            **decoder.stats["trained"].metrics(),
            "acceptance_length_ci95": al_interval(per_prompt["trained draft"]),
            "acceptance_length_by_k": decoder.acceptance_length_by_k(),
            # [drafts, accepted tokens] per prompt, in sample_ids' order: two reports on the
            # same prompts compare by a paired interval (eyrie.evaluate.interval.ratio_interval)
            "per_prompt": [list(c) for c in per_prompt["trained draft"]],
        },
        "untrained": {
            **decoder.stats["untrained"].metrics(),
            "acceptance_length_ci95": al_interval(per_prompt["untrained draft"]),
            "per_prompt": [list(c) for c in per_prompt["untrained draft"]],
        },
        # the trained draft's AL over the untrained one's, paired by prompt (interval.py)
        "trained_over_untrained": ratio_interval(
            per_prompt["trained draft"], per_prompt["untrained draft"]
        ),
    }


def evaluate(paths: EvalPaths, settings: dict) -> dict:
    """Run the evaluation and write eval.json and eval.png; returns the report."""
    cfg = EvalSettings.from_settings(settings)
    inputs = check_inputs(paths, cfg)
    model, eos_id = load_target(paths.target, cfg.device, cfg.dtype)
    proposers = build_proposers(paths.target, inputs, cfg.device, cfg.dtype)
    decoder = Decoder(model, proposers, Decoding(cfg.K, cfg.max_new_tokens, eos_id, inputs.aux_ids))
    log.info(
        "evaluating %s on %d prompts: K=%d, max_new_tokens=%d, aux ids %s, device %s, %s",
        paths.draft,
        len(inputs.prompts),
        cfg.K,
        cfg.max_new_tokens,
        inputs.aux_ids,
        cfg.device,
        cfg.dtype,
    )
    output_tokens = decode_prompts(decoder, inputs.prompts, paths.eval_set)
    sampled = {}
    if cfg.temperature > 0:
        log.info("decoding again by speculative sampling at temperature %s", cfg.temperature)
        sampler = Decoder(model, proposers, decoder.decoding, temperature=cfg.temperature)
        decode_prompts(sampler, inputs.prompts, paths.eval_set)
        # the figures of sampling at eval.temperature, as the greedy ones above them
        sampled = {
            "sampled": {"temperature": cfg.temperature, "seed": SAMPLE_SEED, **runs(sampler)}
        }
    report = {
        "K": cfg.K,
        "num_prompts": len(inputs.prompts),
        "sample_ids": [sample_id for sample_id, _ in inputs.prompts],
        "max_new_tokens": cfg.max_new_tokens,
        "output_tokens": output_tokens,
        "engine": {"name": "hf", "dtype": cfg.dtype, "device": cfg.device},
        **runs(decoder),
        **sampled,
        "outputs_match_target_greedy": not decoder.differs,
        # in 16 bits only (float32 refuses a difference): {run: prompts whose output differed}
        "outputs_differing_from_greedy": decoder.differs,
        "aux_layer_ids": inputs.aux_ids,
        "eos_token_id": eos_id,
        "draft": str(paths.draft),
        "target": str(paths.target),
        "untrained_seed": UNTRAINED_SEED,
        "provenance": provenance(settings),
    }
    plot(paths.plot, report)
    write_json(paths.out, report)
    keep_last_good(paths.out)
    log.info(
        "acceptance length: trained %s, untrained %s -> %s",
        report["trained"]["acceptance_length"],
        report["untrained"]["acceptance_length"],
        paths.out,
    )
    return report


def add_arguments(parser) -> None:
    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--draft", required=True, help="exported draft folder (speculators format)")
    parser.add_argument("--vocab", required=True, help="vocab.safetensors (d2t, t2d)")
    parser.add_argument("--eval-set", required=True, help="eval.parquet with prompt_ids")
    parser.add_argument("--preflight", required=True, help="preflight.json")
    parser.add_argument("--out", required=True, help="eval.json to write")
    parser.add_argument("--plot", required=True, help="eval.png to write")


def run(args) -> int:
    paths = EvalPaths(
        args.target, args.draft, args.vocab, args.eval_set, args.preflight, args.out, args.plot
    )
    evaluate(paths, args.settings)
    return 0

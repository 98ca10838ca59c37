"""Conversations -> tokenized shards with assistant-only loss masks, and a held-out eval split.

`eyrie tokenize --target DIR --inputs F [F ...] --out-dir DIR --settings JSON` writes
`shard_NNN.parquet`, `eval.parquet` and `report.json` into DIR, all at once. Every unusable record
is counted by reason and listed in report.json, or with `data.strict: true` stops the stage.
How records are read, masked and split: docs/data.md; the files: docs/contracts.md#files.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eyrie.chat.samples import (
    TURN_COUNTS,
    check_mode,
    prompt_ids,
    template_traits,
)
from eyrie.chat.template import ChatTemplate
from eyrie.chat.turn import TURN_DROPS
from eyrie.config.stages import DataSettings
from eyrie.core.errors import DataError, TargetError
from eyrie.core.io import atomic_path, keep_last_good, provenance
from eyrie.data.collect import (
    TOP_REASONS,
    Example,
    Record,
    Tally,
    collect_records,
    read_regenerated,
    regenerated_shards,
    split_records,
)
from eyrie.formats.tokenized import EVAL_SCHEMA, SHARD_SCHEMA

log = logging.getLogger(__name__)


def _table(examples: list[Example], with_prompt: list[list[int]] | None = None) -> pa.Table:
    columns = {
        "sample_id": [e.sample_id for e in examples],
        "input_ids": [e.input_ids for e in examples],
        "loss_mask": [e.loss_mask for e in examples],
    }
    if with_prompt is None:
        return pa.table(columns, schema=SHARD_SCHEMA)
    return pa.table({**columns, "prompt_ids": with_prompt}, schema=EVAL_SCHEMA)


def _samples(records: list[Record]) -> list[Example]:
    return [e for r in records for e in r.examples]


def _stats(examples: list[Example]) -> dict:
    return {
        "records": len(examples),
        "tokens": sum(len(e.input_ids) for e in examples),
        "assistant_tokens": sum(sum(e.loss_mask) for e in examples),
        "longest": max((len(e.input_ids) for e in examples), default=0),
    }


@dataclass
class Split:
    """The usable records after the eval split: held out, and the training shards."""

    held_out: list[Record]
    shards: list[list[Record]]


def tokenize(
    target: str | Path,
    inputs: list[str | Path],
    out_dir: str | Path,
    settings: dict,
    regenerated: list[str | Path] = (),
) -> dict:
    """The whole stage: shards, eval.parquet and report.json into `out_dir`; returns the report.
    `regenerated`: the regenerate stage's files, whose versions replace the training records."""
    cfg = DataSettings.from_settings(settings)
    trust = cfg.trust_remote_code
    if not inputs:
        raise DataError("no input files; set data.conversations")
    if cfg.regenerate and not regenerated:
        raise DataError("data.regenerate: true, but no --regenerated files were given")
    tpl = ChatTemplate.load(target, trust, cfg.chat_template_kwargs, cfg.reasoning_parser)
    traits = template_traits(tpl)
    check_mode(traits, cfg.mask_mode, str(target))
    log.info(
        "tokenizing %d file(s) with the chat template of %s (max_seq_len=%d, mask_mode=%s: %s)",
        len(inputs),
        target,
        cfg.max_seq_len,
        cfg.mask_mode,
        "prefix-stable" if traits.prefix_stable else "not prefix-stable",
    )
    tally = collect_records(tpl, inputs, cfg)
    _require_enough(tally, cfg)
    held_out, shards = split_records(tally.records, cfg, tally)
    if regenerated:
        regen = read_regenerated(regenerated)
        shards = regenerated_shards(tpl, shards, regen, cfg, tally)
    split = Split(held_out, shards)
    report = _report(target, tally, cfg, split, traits)
    report["provenance"] = provenance(settings)
    report["regenerated"] = _regenerated_summary(split, tally) if regenerated else None
    prompts = [prompt_ids(tpl, r.conv) for r in held_out]
    report["eval"]["longest_prompt"] = max(map(len, prompts), default=0)
    _write_outputs(out_dir, split, prompts, report)
    for name in ("report.json", "eval.parquet"):
        keep_last_good(Path(out_dir) / name)
    _log_summary(report, out_dir)
    _warn(report)
    return report


def _report(target, tally: Tally, cfg: DataSettings, split: Split, traits) -> dict:
    kept = [*split.held_out, *(r for shard in split.shards for r in shard)]
    modes = {m: sum(r.mode == m for r in kept) for m in ("prefix", "per_turn", "generation")}
    return {
        "target": str(target),
        "tokenizer_hash": _tokenizer_hash(target),
        "inputs": tally.per_file,
        "records_read": tally.records_read,
        "records_used": len(kept),
        "records_dropped": len(tally.dropped),
        "dropped_by_reason": tally.by_reason(),
        "dropped": tally.dropped,
        "truncated": sum(r.truncated for r in kept),
        "max_seq_len": cfg.max_seq_len,
        "masks": {
            "mask_mode": cfg.mask_mode,
            "template": traits.as_dict(),
            "records_by_mode": modes,
            "samples": sum(len(r.examples) for r in kept),
            "samples_dropped_after_truncation": sum(r.dropped_samples for r in kept),
            "train_reasoning": cfg.train_reasoning,
            "reasoning_not_rendered": sum(r.turns.get("reasoning_not_rendered", 0) for r in kept),
            "turns": {k: sum(r.turns.get(k, 0) for r in kept) for k in TURN_COUNTS},
            "turns_dropped": _turns_dropped(kept),
            "dropped_by_template_rule": tally.by_rule(),
            "chat_template_kwargs": cfg.chat_template_kwargs,
            "reasoning_parser": cfg.reasoning_parser,
            "non_text_parts_dropped": sum(r.conv.dropped_parts for r in kept),
        },
        "eval": {"file": "eval.parquet", **_stats([r.examples[0] for r in split.held_out])},
        "shards": [
            {"file": f"shard_{s:03d}.parquet", **_stats(_samples(shard))}
            for s, shard in enumerate(split.shards)
        ],
    }


def _require_enough(tally: Tally, cfg: DataSettings) -> None:
    need = cfg.num_eval + cfg.num_shards
    if len(tally.records) < need:
        fix = ", or fix the dropped records (data.strict: true names the first)"
        fix = tally.cut_fix(cfg.max_seq_len) + (fix if tally.dropped else "")
        raise DataError(
            f"only {len(tally.records)} usable records of {tally.records_read} read (dropped: "
            f"{tally.top_reasons(TOP_REASONS)}); need at least data.num_eval + data.num_shards = "
            f"{cfg.num_eval} + {cfg.num_shards} = {need}: lower data.num_eval/data.num_shards "
            f"or add conversations{fix}"
        )


def _regenerated_summary(split: Split, tally: Tally) -> dict:
    counts = tally.by_reason()
    return {
        "records_used": sum(len(shard) for shard in split.shards),
        "cut": counts.get("regenerate_cut", 0),
        "failed": counts.get("regenerate_failed", 0),
    }


def _tokenizer_hash(target: str | Path) -> str | None:
    from eyrie.arch.target import tokenizer_hash

    try:
        return tokenizer_hash(target)
    except TargetError:
        return None


def _write_outputs(out_dir: str | Path, split: Split, prompts: list[list[int]], report: dict):
    """The shards, eval.parquet and report.json, into `out_dir` at once (row counts checked)."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        for s, shard in enumerate(split.shards):
            pq.write_table(_table(_samples(shard)), tmp / f"shard_{s:03d}.parquet")
        first = [r.examples[0] for r in split.held_out]
        pq.write_table(_table(first, prompts), tmp / "eval.parquet")
        for entry in [*report["shards"], report["eval"]]:  # validate before the rename
            rows = pq.read_metadata(tmp / entry["file"]).num_rows
            assert rows == entry["records"], (entry["file"], rows, entry["records"])
        (tmp / "report.json").write_text(
            json.dumps(report, indent=2, sort_keys=True, default=str) + "\n"
        )


def _log_summary(report: dict, out_dir: str | Path) -> None:
    held_out = report["eval"]["records"]
    log.info(
        "%d records read, %d used (%d eval, %d in %d shards), %d dropped %s, %d truncated -> %s",
        report["records_read"],
        report["records_used"],
        held_out,
        report["records_used"] - held_out,
        len(report["shards"]),
        report["records_dropped"],
        {k: v for k, v in report["dropped_by_reason"].items() if v},
        report["truncated"],
        out_dir,
    )


def _turns_dropped(kept: list) -> dict:
    """The assistant turns of kept records left untrained, by reason (eyrie.chat.turn)."""
    counts = {reason: 0 for reason in TURN_DROPS}
    for record in kept:
        for reason, n in record.turns.get("dropped", {}).items():
            counts[reason] += n
    return counts


def _warn(report: dict) -> None:
    """What the user should know although nothing failed, on the terminal (the log's stderr)."""
    masks = report["masks"]
    if masks["reasoning_not_rendered"]:
        log.warning(
            "%d assistant turn(s) carry reasoning that the chat template renders nowhere (not as "
            "the last turn, not in progress): it is not trained, as the target, prompted through "
            "this template, does not generate it; set data.chat_template_kwargs if the template "
            "has a thinking switch (e.g. {thinking: true}), or drop the field",
            masks["reasoning_not_rendered"],
        )
    if masks["turns"]["stop_appended"]:
        log.warning(
            "%d assistant turn(s) end with the tokenizer's eos appended: the template writes no "
            "stop token (%s) after them; if the model stops on another token, add it to "
            "generation_config.json's eos_token_id",
            masks["turns"]["stop_appended"],
            ", ".join(masks["template"]["stop_tokens"]) or "none",
        )
    if masks["turns"]["without_stop_token"]:
        log.warning(
            "%d assistant turn(s) end without a stop token: the template writes none after them "
            "and none of the target's eos tokens (%s) follows; add the token the model stops on "
            "to generation_config.json's eos_token_id",
            masks["turns"]["without_stop_token"],
            ", ".join(masks["template"]["stop_tokens"]) or "none",
        )
    for reason, n in masks["turns_dropped"].items():
        if n:
            log.warning(
                "%d assistant turn(s) of kept records not trained: %s: %s",
                n,
                reason,
                TURN_DROPS[reason],
            )
    for rule, n in masks["dropped_by_template_rule"].items():
        fix = f": {TURN_DROPS[rule]}" if rule in TURN_DROPS else ""
        log.warning(
            "%d record(s) dropped: the chat template's rule %s%s (report.json)", n, rule, fix
        )
    if masks["non_text_parts_dropped"]:
        log.warning(
            "%d non-text content part(s) left out (data.non_text: keep_text)",
            masks["non_text_parts_dropped"],
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", required=True, help="Hugging Face model folder with the tokenizer"
    )
    parser.add_argument(
        "--inputs", required=True, nargs="+", help="conversation files (.jsonl/.json/.parquet)"
    )
    parser.add_argument(
        "--out-dir", required=True, help="folder for shard_NNN.parquet, eval.parquet, report.json"
    )
    parser.add_argument(
        "--regenerated",
        nargs="+",
        default=[],
        help="the regenerate stage's shard files: their responses replace the training records'",
    )


def run(args: argparse.Namespace) -> int:
    tokenize(args.target, args.inputs, args.out_dir, args.settings, args.regenerated)
    return 0

"""Drafts of several kinds from one extraction, side by side (train.method listing kinds).

The compare stage reads each kind's evaluation (eval.json: the same prompts, decoded for real),
its training summary and its exported draft, and writes compare.json, compare.md (the table) and
compare.png: acceptance length with its interval and at every K' <= K, per-position acceptance,
the AL over the run's draft's (a paired interval: the same prompts, eyrie.evaluate.interval), and
the draft's cost per step: sequential forwards and an estimate of its FLOPs from the weights'
shapes. It names the best kind by AL at K, and says when the interval cannot tell it from the
next. docs/training.md#several-kinds-from-one-extraction.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

from eyrie.core.errors import EvaluateError
from eyrie.core.io import atomic_path, keep_last_good, provenance, write_json
from eyrie.evaluate.interval import ratio_interval

log = logging.getLogger(__name__)

# weights read by lookup (a row per token), not multiplied: no FLOPs
LOOKUPS = ("embed_tokens.", "markov_head.markov_w1.")


def _read_json(path: Path, what: str, fix: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise EvaluateError(f"{path}: {what} not found; {fix}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise EvaluateError(f"{path}: unreadable {what} ({exc}); {fix}") from exc
    if not isinstance(data, dict):
        raise EvaluateError(f"{path}: {what} is not a JSON object; {fix}")
    return data


def weight_shapes(draft_dir: Path) -> dict[str, list[int]]:
    """name -> shape of every floating-point tensor in the draft's safetensors files (their
    headers only): the weights, not the vocabulary maps (d2t, t2d: integers)."""
    shapes = {}
    files = sorted(draft_dir.glob("*.safetensors"))
    if not files:
        raise EvaluateError(f"{draft_dir}: no .safetensors files; export the draft again")
    for path in files:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        shapes.update(
            {
                k: v["shape"]
                for k, v in header.items()
                if k != "__metadata__" and v["dtype"] in ("F64", "F32", "F16", "BF16")
            }
        )
    return shapes


def step_cost(draft_dir: Path, K: int) -> dict:
    """What one draft step of K tokens costs: the draft's parameters, its sequential forwards
    (EAGLE-3 chains K, a block drafter fills its block in one) and an estimate of its FLOPs,
    2 per weight per token (the decoder layers over every token the step feeds them, the head
    and per-position heads over the K drafted, the fc over one new target state; attention over
    the context is not counted, nor the lookups)."""
    config = _read_json(draft_dir / "config.json", "draft config", "export the draft again")
    method = config.get("speculators_model_type", "eagle3")
    sizes: dict[str, int] = {"layers": 0, "fc": 0, "per_position": 0, "lookup": 0}
    for name, shape in weight_shapes(draft_dir).items():
        n = 1
        for d in shape:
            n *= d
        if name.startswith(LOOKUPS) or len(shape) < 2:
            part = "lookup" if name.startswith(LOOKUPS) else "layers"  # norms, biases: tiny
        elif name.startswith("layers."):
            part = "layers"
        elif name.startswith("fc."):
            part = "fc"
        else:
            part = "per_position"  # lm_head, DSpark's markov_w2 and confidence head
        sizes[part] += n
    if method == "eagle3":
        forwards, layer_tokens = K, K
    else:  # the block's slots: the anchor's too, which drafts only when sampled from
        forwards, layer_tokens = 1, K + (0 if config.get("sample_from_anchor") else 1)
    flops = 2 * (layer_tokens * sizes["layers"] + K * sizes["per_position"] + sizes["fc"])
    return {
        "method": method,
        "parameters": sum(sizes.values()),
        "parameters_by_part": sizes,
        "forwards_per_step": forwards,
        "tokens_through_layers": layer_tokens,
        "flops_per_step": flops,
    }


def compare(methods: list[str], evals: list[str], drafts: list[str], out: dict) -> dict:
    """The comparison of `methods` (the run's draft first) from their eval.json and exported
    draft folders; writes out["json"], out["md"], out["plot"] and returns the report."""
    if not len(methods) == len(evals) == len(drafts) >= 2:
        raise EvaluateError(
            f"compare: {len(methods)} methods, {len(evals)} eval.json, {len(drafts)} drafts: "
            "give two or more of each, in the same order"
        )
    reports = [
        _read_json(Path(p), "evaluation report", "run the evaluation again (snakemake)")
        for p in evals
    ]
    first = reports[0]
    for path, rep in zip(evals[1:], reports[1:]):
        if rep.get("sample_ids") != first.get("sample_ids") or rep.get("K") != first.get("K"):
            raise EvaluateError(
                f"{path}: not decoded on the prompts and K of {evals[0]}; a comparison pairs "
                "them: run both evaluations again with one eval set and eval settings"
            )
    K = first["K"]
    rows = []
    for method, path, draft, rep in zip(methods, evals, drafts, reports):
        trained = rep["trained"]
        rows.append(
            {
                "method": method,
                "eval": path,
                "draft": draft,
                "acceptance_length": trained["acceptance_length"],
                "acceptance_length_ci95": trained.get("acceptance_length_ci95"),
                "acceptance_length_by_k": trained.get("acceptance_length_by_k"),
                "per_position_acceptance": trained.get("per_position_acceptance"),
                "over_run_draft": ratio_interval(
                    trained["per_prompt"], first["trained"]["per_prompt"]
                ),
                # with eval.temperature > 0: the AL of speculative sampling at it
                "sampled": {
                    "temperature": rep["sampled"]["temperature"],
                    "acceptance_length": rep["sampled"]["trained"]["acceptance_length"],
                    "acceptance_length_ci95": rep["sampled"]["trained"]["acceptance_length_ci95"],
                }
                if "sampled" in rep
                else None,
                "cost": step_cost(Path(draft), K),
            }
        )
    report = {
        "K": K,
        "num_prompts": first["num_prompts"],
        "engine": first.get("engine"),
        "methods": rows,
        **best_of(rows, reports),
        "provenance": provenance(),
    }
    write_json(out["json"], report)
    with atomic_path(out["md"]) as tmp:
        tmp.write_text(table(report))
    plot(out["plot"], report)
    for path in out.values():
        keep_last_good(path)
    log.info("best draft kind at K=%d: %s (%s)", K, report["best"], report["best_note"])
    return report


def best_of(rows: list[dict], reports: list[dict]) -> dict:
    """The kind with the highest AL at K, and its AL over the runner-up's with the paired
    interval: when that interval holds 1 the evaluation cannot tell them apart."""
    order = sorted(range(len(rows)), key=lambda i: -(rows[i]["acceptance_length"] or 0.0))
    top, second = order[0], order[1]
    versus = ratio_interval(
        reports[top]["trained"]["per_prompt"], reports[second]["trained"]["per_prompt"]
    )
    ci = (versus or {}).get("ci95")
    if ci is None:
        note = "no drafts to compare"
    elif ci[0] > 1.0:
        note = f"ahead of {rows[second]['method']} beyond the 95% interval"
    elif ci[0] == ci[1] == 1.0:
        note = f"tied with {rows[second]['method']} (the same acceptance on every prompt)"
    else:
        more = versus.get("prompts_for_3pct")
        note = (
            f"within the 95% interval of {rows[second]['method']}; about {more} prompts "
            "would resolve 3%"
            if more
            else f"within the 95% interval of {rows[second]['method']}"
        )
    return {"best": rows[top]["method"], "best_over_next": versus, "best_note": note}


def _fmt(x, digits=3):
    return "n/a" if x is None else f"{x:.{digits}f}"


def table(report: dict) -> str:
    """compare.md: one row per kind, the run's draft first."""
    K = report["K"]
    lines = [
        f"# Draft kinds side by side (K = {K}, {report['num_prompts']} prompts)",
        "",
        f"Best: **{report['best']}**, {report['best_note']}.",
        "",
        "| kind | AL | 95% interval | AL / run's draft (95%) | AL by K' = 1.."
        + str(K)
        + " | acceptance by position | forwards / step | GFLOPs / step (est.) | parameters |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["methods"]:
        ci = row["acceptance_length_ci95"]
        ratio = row["over_run_draft"] or {}
        rci = ratio.get("ci95")
        cost = row["cost"]
        lines.append(
            "| "
            + " | ".join(
                [
                    row["method"],
                    _fmt(row["acceptance_length"]),
                    f"{_fmt(ci[0])}–{_fmt(ci[1])}" if ci else "n/a",
                    f"{_fmt(ratio.get('ratio'))} ({_fmt(rci[0])}–{_fmt(rci[1])})" if rci else "n/a",
                    " ".join(_fmt(a, 2) for a in row["acceptance_length_by_k"] or []),
                    " ".join(_fmt(a, 2) for a in row["per_position_acceptance"] or []),
                    str(cost["forwards_per_step"]),
                    f"{cost['flops_per_step'] / 1e9:.3g}",
                    f"{cost['parameters']:,}",
                ]
            )
            + " |"
        )
    sampled = [row for row in report["methods"] if row["sampled"]]
    if sampled:
        t = sampled[0]["sampled"]["temperature"]
        lines += [
            "",
            f"Sampled at temperature {t}: "
            + ", ".join(
                f"{row['method']} AL {_fmt(row['sampled']['acceptance_length'])}" for row in sampled
            )
            + ".",
        ]
    lines += [
        "",
        "AL / run's draft: paired over the same prompts (bootstrap). GFLOPs: 2 per weight per "
        "token through the draft, attention over the context not counted.",
        "",
    ]
    return "\n".join(lines)


def plot(path: str | Path, report: dict) -> None:
    """compare.png: each kind's AL at every K' <= K (left) and acceptance by position (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = report["K"]
    fig, (ax_k, ax_p) = plt.subplots(1, 2, figsize=(10, 3.5))
    for row in report["methods"]:
        label = f"{row['method']} (AL {_fmt(row['acceptance_length'])})"
        ax_k.plot(range(1, K + 1), row["acceptance_length_by_k"] or [None] * K, "o-", label=label)
        ax_p.plot(range(1, K + 1), row["per_position_acceptance"] or [None] * K, "o-", label=label)
    ax_k.set(xlabel="K'", ylabel="acceptance length", xticks=range(1, K + 1))
    ax_p.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05))
    ax_p.set_xticks(range(1, K + 1))
    ax_k.legend(fontsize=8)
    fig.suptitle(f"best: {report['best']} ({report['best_note']})", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def add_arguments(parser) -> None:
    parser.add_argument("--methods", nargs="+", required=True, help="the kinds, run's draft first")
    parser.add_argument("--evals", nargs="+", required=True, help="their eval.json, in order")
    parser.add_argument("--drafts", nargs="+", required=True, help="their exported draft folders")
    parser.add_argument("--out", required=True, help="compare.json to write")
    parser.add_argument("--table", required=True, help="compare.md to write")
    parser.add_argument("--plot", required=True, help="compare.png to write")


def run(args) -> int:
    out = {"json": args.out, "md": args.table, "plot": args.plot}
    compare(args.methods, args.evals, args.drafts, out)
    return 0

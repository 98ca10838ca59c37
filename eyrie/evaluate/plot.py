"""eval.png: what the evaluate stage's report shows at a glance (matplotlib, written atomically)."""

from __future__ import annotations

from pathlib import Path

from eyrie.core.errors import EvaluateError
from eyrie.core.io import atomic_path


def plot(path: str | Path, report: dict) -> None:
    """eval.png: per-position acceptance of both drafts (left) and the trained draft's acceptance
    length at every K' <= K (right); the title names the engine and dtype of the figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def fmt(al):
        return "n/a" if al is None else f"{al:.3f}"

    K, trained, untrained, engine = (
        report["K"],
        report["trained"],
        report["untrained"],
        report["engine"],
    )
    positions = list(range(1, K + 1))
    width = 0.4
    fig, (ax, ax_k) = plt.subplots(1, 2, figsize=(max(4.0, 1.2 * K + 2) + 4, 3.5))
    for offset, (label, m) in zip(
        (-width / 2, width / 2), (("trained", trained), ("untrained", untrained))
    ):
        values = m["per_position_acceptance"] or [0.0] * K
        label = f"{label} (AL {fmt(m['acceptance_length'])})"
        ax.bar([p + offset for p in positions], values, width, label=label)
    ax.set_xticks(positions)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.legend()
    by_k = [float("nan") if al is None else al for al in trained["acceptance_length_by_k"]]
    ax_k.plot(positions, by_k, marker="o", label="trained")
    ax_k.set_xticks(positions)
    ax_k.set_xlabel("K (draft tokens per verification)")
    ax_k.set_ylabel("acceptance length")
    ax_k.legend()
    fig.suptitle(
        f"K={K}: AL trained {fmt(trained['acceptance_length'])} vs untrained "
        f"{fmt(untrained['acceptance_length'])} ({engine['name']}, {engine['dtype']})"
    )
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
        if tmp.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
            raise EvaluateError(f"{path}: matplotlib did not write a PNG")
    plt.close(fig)

"""The demo's output: one table of the three runs, the verdict under it, and an optional
plot of committed records over time."""

from __future__ import annotations

from collections.abc import Sequence

from rayflow.demo.runs import RunReport

__all__ = ["format_table", "format_verdicts", "plot_runs", "PlotUnavailableError"]

_HEADERS = (
    "guarantee",
    "expected",
    "committed",
    "lost",
    "duplicated",
    "checkpoints",
    "mean checkpoint",
    "throughput",
    "kills",
)


def _row(r: RunReport) -> tuple[str, ...]:
    c = r.count
    mean = "-" if r.mean_checkpoint_s is None else f"{r.mean_checkpoint_s * 1000:,.0f} ms"
    kills = f"{r.kills_fired} of {r.kills_planned}"
    if r.failed is not None:
        kills += ", job failed"
    return (
        r.guarantee.label,
        f"{c.expected:,}",
        f"{c.committed:,}",
        f"{c.lost:,}",
        f"{c.duplicated:,}",
        f"{r.checkpoints_completed:,}",
        mean,
        f"{r.throughput:,.0f} rec/s",
        kills,
    )


def format_table(reports: Sequence[RunReport]) -> str:
    """The runs as an aligned text table (text left, numbers right)."""
    rows = [_HEADERS, *(_row(r) for r in reports)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADERS))]
    left = {0, len(_HEADERS) - 1}

    def line(row: Sequence[str]) -> str:
        cells = [
            cell.ljust(widths[i]) if i in left else cell.rjust(widths[i])
            for i, cell in enumerate(row)
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(rows[0]), rule, *(line(row) for row in rows[1:])])


def format_verdicts(reports: Sequence[RunReport]) -> str:
    """One line per run: what it shows, or how it broke its guarantee."""
    lines = []
    for r in reports:
        c = r.count
        problem = r.broken()
        if problem is not None:
            lines.append(f"{r.guarantee.label}: GUARANTEE BROKEN: {problem}")
            continue
        if r.guarantee.value == "NONE":
            how = (
                f"failed at the first kill, with no checkpoint to restart from: {c.lost:,} "
                "orders lost, none twice (at most once)"
                if r.failed is not None
                else f"{c.lost:,} lost, none twice (at most once)"
            )
        elif r.guarantee.value == "AT_LEAST_ONCE":
            how = (
                f"nothing lost; {c.duplicated:,} repeated orders (rows written again by "
                "replays from the last checkpoint)"
            )
            if r.largest_dip:
                how += (
                    f"; readers saw up to {r.largest_dip:,} committed orders vanish while a "
                    "replay rewrote a part under its old name"
                )
            how += " (at least once)"
        else:
            how = "every order committed exactly once"
        lines.append(f"{r.guarantee.label}: {how}")
    return "\n".join(lines)


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def plot_runs(reports: Sequence[RunReport], path: str, title: str) -> None:
    """Committed records over time, one curve per run, with the expected count; a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import StrMethodFormatter
    except ImportError as exc:
        raise PlotUnavailableError(
            f"--plot needs matplotlib ({exc}): pip install matplotlib "
            '(or pip install "rayflow[demo]")'
        ) from None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in reports:
        times = [t for t, _ in r.samples]
        counts = [n for _, n in r.samples]
        label = f"{r.guarantee.label}: {r.count.committed:,} committed"
        (curve,) = ax.step(times, counts, where="post", label=label)
        if r.failed is not None and times:
            ax.plot(times[-1], counts[-1], "x", color=curve.get_color(), markersize=9)
    if reports:
        ax.axhline(
            reports[0].count.expected, color="grey", linestyle=":", label="orders in the input"
        )
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("records committed (visible to readers)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

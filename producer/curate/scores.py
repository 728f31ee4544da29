"""A dataset's scores as `sdq dataset show` shows them (ProducerHooks, producer/curate/hooks.py):
each score's range and mean, its histogram and the samples at either end, as the view
sample_quality has every sample's latest; in the terminal, and on the dataset's page with a
filter's cut marked and the samples' images."""

from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from sdq.models.datasets import derived_from
from sdq.models.store import ObjectStore
from sdq.producer import display
from sdq.producer.datasets.page import sample_html, shard_samples

SCORES = ("clip_score", "aesthetic", "nsfw")


HISTOGRAM_BINS = 20


EXTREMES = 4  # samples shown at each end of each score


def scores_of(session: Session, summary: dict[str, Any]) -> dict[str, Any]:
    """What `sdq dataset show` adds of curate's (ProducerHooks): the dataset's scores."""
    return {"scores": score_summary(session, summary["name"])}


def score_summary(session: Session, name: str) -> dict[str, Any] | None:
    """Each score of the dataset's samples, as the view sample_quality has their latest:
    its range and mean, its histogram, and the samples at either end (None before any
    curate run scored them)."""
    figures = ", ".join(f"min({score}), avg({score}), max({score})" for score in SCORES)
    row = session.execute(
        text(f"SELECT count(clip_score), {figures} FROM sample_quality WHERE dataset = :name"),
        {"name": name},
    ).one()
    if not row[0]:
        return None
    summary: dict[str, Any] = {"samples": row[0]}
    for index, score in enumerate(SCORES):
        low, mean, high = row[1 + 3 * index : 4 + 3 * index]
        if mean is not None:
            summary[score] = {
                "min": round(low, 3),
                "mean": round(mean, 3),
                "max": round(high, 3),
                "histogram": _histogram(session, name, score, low, high),
                "lowest": _extreme(session, name, score, "ASC"),
                "highest": _extreme(session, name, score, "DESC"),
            }
    return summary


def _histogram(session: Session, name: str, score: str, low: float, high: float) -> list[int]:
    """Samples per bin, HISTOGRAM_BINS equal bins from the lowest score to the highest."""
    if high <= low:
        return [session.scalar(text(f"SELECT count({score}) FROM sample_quality "
                                    "WHERE dataset = :name"), {"name": name})]  # fmt: skip
    width = (high - low) / HISTOGRAM_BINS
    if session.get_bind().dialect.name == "postgresql":
        binned = f"width_bucket({score}, :low, :high, {HISTOGRAM_BINS}) - 1"
    else:
        binned = f"CAST(({score} - :low) / :width AS INTEGER)"
    counts = [0] * HISTOGRAM_BINS
    for number, samples in session.execute(
        text(f"SELECT {binned} AS bin, count(*) FROM sample_quality "
             f"WHERE dataset = :name AND {score} IS NOT NULL GROUP BY bin"),
        {"name": name, "low": low, "high": high, "width": width},
    ):  # fmt: skip
        counts[min(max(number, 0), HISTOGRAM_BINS - 1)] += samples  # the top edge: the last
    return counts


def _extreme(session: Session, name: str, score: str, order: str) -> list[dict[str, Any]]:
    """The samples with the lowest (ASC) or highest (DESC) score, and their shards."""
    rows = session.execute(
        text(f"SELECT q.key, q.{score}, h.number FROM sample_quality q "
             "JOIN samples s ON s.id = q.sample_id JOIN shards h ON h.id = s.shard_id "
             f"WHERE q.dataset = :name AND q.{score} IS NOT NULL "
             f"ORDER BY q.{score} {order}, q.key LIMIT {EXTREMES}"),
        {"name": name},
    )  # fmt: skip
    return [{"key": key, "score": round(value, 3), "shard": shard} for key, value, shard in rows]


def extreme_samples(store: ObjectStore, summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The samples at either end of each score, with their images, by key."""
    wanted: dict[int, set[str]] = {}
    for figures in (summary.get("scores") or {}).values():
        if isinstance(figures, dict):
            for sample in figures["lowest"] + figures["highest"]:
                wanted.setdefault(sample["shard"], set()).add(sample["key"])
    return {sample["key"]: sample for number, keys in wanted.items()
            for sample in shard_samples(store, summary, number, keys)}  # fmt: skip


def _scored(sample: dict[str, Any], score: float) -> str:
    return sample_html({**sample, "key": f"{sample['key']} ({score})"})


def _histogram_svg(figures: dict[str, Any], cut: float | None) -> str:
    """An SVG bar per bin from the lowest score to the highest, the cut as a red rule."""
    counts, low, high = figures["histogram"], figures["min"], figures["max"]
    width, height, bar = 400, 100, 400 / len(counts)
    tallest = max(counts) or 1
    bars = "".join(
        f'<rect class="bar" x="{index * bar:.1f}" y="{height - count / tallest * height:.1f}" '
        f'width="{bar - 1:.1f}" height="{count / tallest * height:.1f}">'
        f"<title>{count}</title></rect>"
        for index, count in enumerate(counts)
    )
    if cut is not None and high > low:
        x = min(max((cut - low) / (high - low), 0), 1) * width
        bars += f'<rect class="cut" x="{max(x - 1, 0):.1f}" y="0" width="2" height="{height}"/>'
    return (f'<svg class="histogram" width="{width}" height="{height}">{bars}</svg>'
            f"<p>{low} to {high}, mean {figures['mean']}"
            f"{f', cut at {cut:g}' if cut is not None else ''}</p>")  # fmt: skip


def scores_html(summary: dict[str, Any], store: ObjectStore) -> str:
    """Each score's histogram with the filter's cut, and the samples at either end."""
    extremes = extreme_samples(store, summary)
    cuts = summary["options"].get("cuts", {})
    parts = []
    for score, figures in (summary.get("scores") or {}).items():
        if not isinstance(figures, dict):
            continue
        parts += [f'<h2 class="score">{score}</h2>', _histogram_svg(figures, cuts.get(score))]
        for end in ("lowest", "highest"):
            shown = [_scored(extremes[sample["key"]], sample["score"])
                     for sample in figures[end] if sample["key"] in extremes]  # fmt: skip
            parts.append(f'<h3>{end}</h3><div class="samples {end}">{"".join(shown)}</div>')
    return "\n".join(parts)


def show_scores(summary: dict[str, Any]) -> None:
    """The scores' ranges in the terminal (`sdq dataset show`)."""
    if summary.get("scores"):
        scores = summary["scores"]
        rows = [{"score": name, **figures} for name, figures in scores.items() if name != "samples"]
        title = f"scores of {scores['samples']} samples (sdq curate)"
        if source := derived_from(summary["options"]):  # the filter's cut shows against them
            title = f"scores of the {scores['samples']} samples of {source}, before the filter"
        display.stdout.print(display.rows_table(rows, ["score", "min", "mean", "max"], title=title))

"""A train run's page: where it stands and how fast, the loss and learning rate curves and
every score's, its checkpoints and, per checkpoint, the validation images (the section is
left out when the run renders none).

Written into the store beside the galleries (runs/<run>/training.html), linking its images
as they do: relative in a local store folder, presigned in S3. The worker that records a
checkpoint draws it anew, and so does `sdq train status`.
"""

import html
from collections import defaultdict
from typing import Any

from sqlalchemy.orm import Session

from sdq.models.generate.galleries import ImageLink, store_image_link
from sdq.models.store import ObjectStore
from sdq.models.tables import Run
from sdq.models.train.status import train_status, validation_images

WIDTH, HEIGHT = 640, 200
PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>sdq train run {run_id}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 1.5rem; color: #222; }}
svg {{ border: 1px solid #ddd; background: #fafafa; }}
table {{ border-collapse: collapse; margin-top: 1rem; }}
th, td {{ border: 1px solid #ddd; padding: .4rem; vertical-align: top; }}
th {{ background: #f6f6f6; font-weight: 600; }}
td img {{ width: 128px; image-rendering: pixelated; display: block; }}
.missing {{ width: 128px; color: #a00; }}
</style></head><body>
<h1>Train run {run_id}</h1><p>{summary}</p><p>{speed}</p>{buckets}
<h2>Loss</h2>{curve}
<h2>Learning rate</h2>{learning_rate}
{scores}{checkpoints}{validation}</body></html>
"""
CHECKPOINTS = """<h2>Checkpoints</h2>
<table><thead><tr><th>step</th><th>holds</th><th>where</th></tr></thead><tbody>
{rows}
</tbody></table>
"""
VALIDATION = """<h2>Validation images</h2>
<table><thead><tr><th>step</th>{prompt_headers}</tr></thead><tbody>
{rows}
</tbody></table>
"""


def page_key(run_id: int) -> str:
    return f"runs/{run_id}/training.html"


def draw_page(session: Session, store: ObjectStore, run: Run) -> dict[str, Any]:
    """Writes the run's page as it stands now; returns the status it shows."""
    status = train_status(session, run)
    images = validation_images(session, run.id)
    page = training_html(status, images, store_image_link(store))
    store.put_bytes(page_key(run.id), page.encode(), content_type="text/html; charset=utf-8")
    return status


def training_html(
    status: dict[str, Any], images: list[dict[str, Any]], image_link: ImageLink
) -> str:
    return PAGE.format(
        run_id=status["run_id"],
        summary=html.escape(
            f"{status['status']}: step {status['step']} of {status['steps']}, "
            f"{status['dataset']} on {status['base']}, model {status['model']}"
        ),
        speed=html.escape(speed_text(status)),
        buckets=f"<p>{html.escape(buckets_text(status))}</p>" if status["buckets"] else "",
        curve=curve_svg(status["losses"]),
        learning_rate=curve_svg(status["learning_rates"]),
        scores="".join(
            f"<h2>{html.escape(metric)}</h2>{curve_svg(curve)}"
            for metric, curve in status["scores"].items()
        ),
        checkpoints=_checkpoints(status["checkpoints"]) if status["checkpoints"] else "",
        validation=_validation(images, image_link) if images else "",
    )


def speed_text(status: dict[str, Any]) -> str:
    """The recent steps' speed, MFU and the time left, as `sdq train status` says them."""
    if not status["samples_per_second"]:
        return "no speed yet"
    eta = status["eta_seconds"]
    left = f", about {eta // 60} min {eta % 60} s left" if eta else ""
    ranks = f" on {status['world_size']} ranks" if status["world_size"] > 1 else ""
    mfu = f", MFU {status['mfu']:.1%}" if status["mfu"] is not None else ""
    return f"{status['samples_per_second']:.1f} samples/s{ranks}{mfu}{left}"


def buckets_text(status: dict[str, Any]) -> str:
    """A run on buckets: the steps it trained in each."""
    mix = status["buckets"]
    return "steps per bucket: " + ", ".join(f"{shape} {steps}" for shape, steps in mix.items())


def checkpoint_holds(checkpoint: dict[str, Any]) -> str:
    if checkpoint["deleted"]:
        return "deleted"
    return "model" if checkpoint["model_revision"] else "training state"


def _checkpoints(checkpoints: list[dict[str, Any]]) -> str:
    rows = "\n".join(
        f"<tr><td>{c['step']}</td><td>{checkpoint_holds(c)}</td><td>{html.escape(c['uri'])}</td></tr>"
        for c in checkpoints
    )
    return CHECKPOINTS.format(rows=rows)


def _validation(images: list[dict[str, Any]], image_link: ImageLink) -> str:
    """One row per checkpoint, one column per validation prompt and seed."""
    prompts = list(dict.fromkeys((image["prompt"], image["seed"]) for image in images))
    cells: dict[tuple[int, str, int], dict[str, Any]] = {}
    by_step: dict[int, list] = defaultdict(list)
    for image in images:
        cells[(image["step"], image["prompt"], image["seed"])] = image
        by_step[image["step"]].append(image)
    rows = "\n".join(
        "<tr><th>{}</th>{}</tr>".format(
            step,
            "".join(
                f"<td>{_image(cells.get((step, *prompt)), image_link)}</td>" for prompt in prompts
            ),
        )
        for step in sorted(by_step)
    )
    return VALIDATION.format(
        prompt_headers="".join(
            f"<th>{html.escape(prompt)} (seed {seed})</th>" for prompt, seed in prompts
        ),
        rows=rows,
    )


def curve_svg(curve: list[tuple[int, float | None]]) -> str:
    """Values against their steps (the loss at every step, a score at each checkpoint
    scored) as an SVG polyline, scaled to the box; the steps whose value is not finite
    (None: a diverged checkpoint's score) named under it."""
    values = [(step, value) for step, value in curve if value is not None]
    not_finite = [str(step) for step, value in curve if value is None]
    said = f"<p>not finite at steps {', '.join(not_finite)}</p>" if not_finite else ""
    if not values:
        return said or "<p>no steps yet</p>"
    steps, ys = [step for step, _ in values], [value for _, value in values]
    low, high = min(ys), max(ys)
    span, first = (high - low) or 1.0, steps[0]
    step_width = WIDTH / max(1, steps[-1] - first)
    points = " ".join(
        f"{(step - first) * step_width:.1f},{HEIGHT - (value - low) / span * HEIGHT:.1f}"
        for step, value in values
    )
    return (
        f'<svg width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}">'
        f'<polyline fill="none" stroke="#36c" points="{points}"/></svg>'
        f"<p>{high:.4f} (top) to {low:.4f} (bottom), steps {first} to {steps[-1]}</p>{said}"
    )


def _image(image: dict[str, Any] | None, image_link: ImageLink) -> str:
    if image is None:
        return '<div class="missing">none</div>'
    if image["status"] != "succeeded":
        return f'<div class="missing">{html.escape(image["status"])}</div>'
    alt = html.escape(f"{image['prompt']} at step {image['step']}")
    return f'<img src="{html.escape(image_link(image["spec_hash"]))}" alt="{alt}">'

"""A generation run's contact sheet: one row per prompt-file row, labelled by its text, one
column per style; each image links to its full-size file and shows its seed, and the page
states the settings the run was rendered with. Written by `sdq gallery` and `sdq run`, and
by beat's run finisher for every generation run that finishes.

Where the images are linked from depends on who opens the page: a local store's page sits
next to them (relative links); an S3 store's page is opened by a presigned link and links
its images the same way; a local copy (`sdq gallery RUN -o DIR`) carries its own images.
"""

import html
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from sqlalchemy import RowMapping, select
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.generate.specs import SAMPLER_NAMES, image_key
from sdq.models.generate.tables import Generation
from sdq.models.specs import AUTO_DTYPE
from sdq.models.store import LINK_SECONDS, ObjectStore, S3Store
from sdq.models.tables import Job

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>sdq run {run_id}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 1.5rem; color: #222; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ddd; padding: .4rem; vertical-align: top; }}
th {{ background: #f6f6f6; font-weight: 600; text-align: left; }}
th.row {{ max-width: 16rem; }} th.row small {{ color: #888; font-weight: normal; }}
td img {{ width: 160px; image-rendering: pixelated; display: block; }}
figure {{ margin: 0 0 .4rem; }} figcaption {{ font-size: 11px; color: #666; width: 160px; }}
.missing {{ width: 160px; height: 40px; color: #a00; }}
</style></head><body>
<h1>Run {run_id}</h1>
<p class="settings">{settings}</p><p class="summary">{summary}</p>
<table><thead><tr><th>prompt</th>{style_headers}</tr></thead><tbody>
{rows}
</tbody></table></body></html>
"""

# A link to one image, given its spec hash.
ImageLink = Callable[[str], str]


def gallery_key(run_id: int) -> str:
    return f"runs/{run_id}/gallery.html"


def gallery_html(run_id: int, jobs: list[dict[str, Any]], image_link: ImageLink) -> str:
    """`jobs`: dicts with source_line, subject, style, prompt, seed, flagged, status,
    spec_hash and spec, in the run's order."""
    styles = list(dict.fromkeys(job["style"] for job in jobs))
    cells: dict[tuple[int | None, str | None], list[dict[str, Any]]] = defaultdict(list)
    subjects: dict[int | None, str] = {}
    for job in jobs:
        cells[(job["source_line"], job["style"])].append(job)
        subjects.setdefault(job["source_line"], job["subject"] or job["prompt"])
    rows = "\n".join(
        "<tr>{}{}</tr>".format(
            _row_header(line, subject),
            "".join(f"<td>{_figures(cells[(line, style)], image_link)}</td>" for style in styles),
        )
        for line, subject in subjects.items()
    )
    done = sum(job["status"] == "succeeded" and not job["flagged"] for job in jobs)
    return PAGE.format(
        run_id=run_id,
        settings=html.escape(describe_settings([job["spec"] for job in jobs])),
        summary=f"{done} of {len(jobs)} images",
        style_headers="".join(f"<th>{html.escape(style or '(no style)')}</th>" for style in styles),
        rows=rows,
    )


def describe_settings(specs: list[dict[str, Any]]) -> str:
    """Model, steps, size, sampler, guidance and dtype: each value the run used, in order."""

    def values(describe: Callable[[dict[str, Any]], str]) -> str:
        return " / ".join(dict.fromkeys(describe(spec) for spec in specs))

    parts = [
        values(lambda s: f"model {s['model_name']} ({s['model_revision'][:10]})"),
        values(lambda s: f"{s['steps']} steps"),
        values(lambda s: f"{s['width']}x{s['height']}"),
        values(lambda s: f"sampler {SAMPLER_NAMES.get(s['scheduler'], s['scheduler'])}"),
        values(lambda s: f"CFG {s['guidance']:g}"),
        values(_dtype),
    ]
    return ", ".join(parts) if specs else "no images"


def _dtype(spec: dict[str, Any]) -> str:
    # "auto" is decided where the work ran: say what it means.
    if spec["dtype"] == AUTO_DTYPE:
        return f"{AUTO_DTYPE} (float16 on a GPU, float32 on a CPU)"
    return spec["dtype"]


def _row_header(line: int | None, subject: str) -> str:
    where = f"<br><small>line {line}</small>" if line is not None else ""
    return f'<th class="row">{html.escape(subject)}{where}</th>'


def _figures(jobs: list[dict[str, Any]], image_link: ImageLink) -> str:
    return "".join(_figure(job, image_link) for job in jobs)


def _figure(job: dict[str, Any], image_link: ImageLink) -> str:
    if job["flagged"]:
        return '<figure><div class="missing">flagged by the safety checker</div></figure>'
    if job["status"] != "succeeded":
        return f'<figure><div class="missing">{html.escape(job["status"])}</div></figure>'
    source = html.escape(image_link(job["spec_hash"]))
    alt = html.escape(job["prompt"])
    return (
        f'<figure><a href="{source}"><img src="{source}" alt="{alt}"></a>'
        f"<figcaption>seed {job['seed']}</figcaption></figure>"
    )


def store_image_link(store: ObjectStore) -> ImageLink:
    """How a page kept in the store links its images: presigned in S3 (a private bucket
    serves nothing unsigned), relative elsewhere, so a store folder opens as it is and
    from any static host of it."""
    if isinstance(store, S3Store):
        return lambda spec_hash: store.link(image_key(spec_hash), expires_seconds=LINK_SECONDS)
    # From runs/<run>/gallery.html up to the store's root, then to the image.
    return lambda spec_hash: f"../../{image_key(spec_hash)}"


def gallery_jobs(session: Session, run_id: int) -> list[dict[str, Any]]:
    """What the page shows of each of the run's jobs, in the run's order."""
    rows = session.execute(
        select(Generation.source_line, Generation.subject, Generation.style, Generation.prompt,
               Generation.seed, Generation.flagged, Job.status, Job.spec_hash, Job.spec)
        .join(Generation, Generation.job_id == Job.id)
        .where(Job.run_id == run_id)
        .order_by(Job.id)
    ).mappings()  # fmt: skip
    return [_with_status_text(row) for row in rows]


def _with_status_text(row: RowMapping) -> dict[str, Any]:
    return {**row, "status": str(row["status"])}


def write_gallery(
    sessions: sessionmaker[Session], store: ObjectStore, run_id: int
) -> dict[str, str]:
    """Writes the page next to the run's images in the store; returns where it lies and the
    link a browser opens it by."""
    with sessions() as session:
        jobs = gallery_jobs(session, run_id)
    key = gallery_key(run_id)
    page = gallery_html(run_id, jobs, store_image_link(store)).encode()
    uri = store.put_bytes(key, page, content_type="text/html; charset=utf-8")
    return {"gallery": uri, "gallery_link": store.link(key, expires_seconds=LINK_SECONDS)}

"""A run's contact sheet: one row per prompt-file line, one column per style.

Written next to the images in the store (runs/<run>/gallery.html) with relative links, so
it opens from a local store folder as it is, and from any static host of the store.
"""

import html
from collections import defaultdict
from typing import Any

from sdq.models.specs import image_key

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>sdq run {run_id}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 1.5rem; color: #222; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ddd; padding: .4rem; vertical-align: top; }}
th {{ background: #f6f6f6; font-weight: 600; }}
td img {{ width: 160px; image-rendering: pixelated; display: block; }}
figure {{ margin: 0 0 .4rem; }} figcaption {{ font-size: 11px; color: #666; width: 160px; }}
.missing {{ width: 160px; height: 40px; color: #a00; }}
</style></head><body>
<h1>Run {run_id}</h1><p>{summary}</p>
<table><thead><tr><th>line</th>{style_headers}</tr></thead><tbody>
{rows}
</tbody></table></body></html>
"""


def gallery_key(run_id: int) -> str:
    return f"runs/{run_id}/gallery.html"


def gallery_html(run_id: int, jobs: list[dict[str, Any]]) -> str:
    """`jobs`: dicts with source_line, style, prompt, seed, status and spec_hash."""
    styles = list(dict.fromkeys(job["style"] for job in jobs))
    cells: dict[tuple[int | None, str | None], list[dict[str, Any]]] = defaultdict(list)
    for job in jobs:
        cells[(job["source_line"], job["style"])].append(job)
    lines = list(dict.fromkeys(job["source_line"] for job in jobs))
    rows = "\n".join(
        "<tr><th>{}</th>{}</tr>".format(
            line, "".join(f"<td>{_figures(cells[(line, style)])}</td>" for style in styles)
        )
        for line in lines
    )
    done = sum(job["status"] == "succeeded" for job in jobs)
    return PAGE.format(
        run_id=run_id,
        summary=f"{done} of {len(jobs)} images",
        style_headers="".join(f"<th>{html.escape(style or '(no style)')}</th>" for style in styles),
        rows=rows,
    )


def _figures(jobs: list[dict[str, Any]]) -> str:
    return "".join(_figure(job) for job in jobs)


def _figure(job: dict[str, Any]) -> str:
    caption = html.escape(f"{job['prompt']} (seed {job['seed']})")
    if job["status"] != "succeeded":
        return f'<figure><div class="missing">{html.escape(job["status"])}</div></figure>'
    # From runs/<run>/gallery.html up to the store's root, then to the image.
    source = f"../../{image_key(job['spec_hash'])}"
    return (
        f'<figure><img src="{source}" alt="{caption}"><figcaption>{caption}</figcaption></figure>'
    )

"""A dataset's page: what it holds, what failed and why, what a filter left out by which
rule, what each kind adds (curate's scores: ProducerHooks.dataset_page), and a sheet of its
first samples with their captions. Written into the store
(datasets/<name>/index.html) by `sdq dataset show`; the sample images are taken out of the
shards and embedded in the page, so it opens from anywhere, a local file included, with no
link to follow."""

import base64
import html
import io
from collections.abc import Callable, Container
from typing import Any

from sdq.models.datasets import derived_from, shard_key
from sdq.models.store import ObjectStore

SAMPLES_SHOWN = 48
MIME = {"jpg": "image/jpeg", "webp": "image/webp", "png": "image/png"}

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>sdq dataset {name}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 1.5rem; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1rem; }}
th, td {{ border: 1px solid #ddd; padding: .3rem .5rem; text-align: left; }}
th {{ background: #f6f6f6; font-weight: 600; }}
.samples {{ display: flex; flex-wrap: wrap; gap: .6rem; }}
.histogram .bar {{ fill: #6b8cce; }} .histogram .cut {{ fill: #c0392b; }}
figure {{ margin: 0; width: 160px; }} figure img {{ width: 160px; display: block; }}
figcaption {{ font-size: 11px; color: #555; }}
</style></head><body>
<h1>Dataset {name}</h1>
<p class="summary">{summary}</p>
<h2>Samples by status</h2>
<table class="status"><thead><tr><th>status</th><th>samples</th></tr></thead><tbody>
{statuses}
</tbody></table>
<h2>Why samples failed</h2>
<table class="reasons"><thead><tr><th>reason</th><th>samples</th></tr></thead><tbody>
{reasons}
</tbody></table>
{made_of}
{sections}
<h2>First samples</h2>
<div class="samples">{samples}</div>
</body></html>
"""


def page_key(name: str) -> str:
    return f"datasets/{name}/index.html"


def first_samples(
    store: ObjectStore, summary: dict[str, Any], kept: Callable[[int], Container[str]]
) -> list[dict[str, Any]]:
    """Up to SAMPLES_SHOWN kept samples, from the first shards written, in key order: a
    dataset made of another's samples shows its members, from the files that hold them."""
    samples: list[dict[str, Any]] = []
    for shard in summary["shards"]:
        if len(samples) >= SAMPLES_SHOWN:
            break
        if shard["done"]:
            samples += shard_samples(store, summary, shard["number"], kept(shard["number"]))
    return samples[:SAMPLES_SHOWN]


def shard_samples(
    store: ObjectStore, summary: dict[str, Any], number: int, keys: Container[str]
) -> list[dict[str, Any]]:
    """The samples keyed of one of the dataset's shards, read from the file that holds them."""
    import pyarrow.parquet as pq  # only here: its import slows every `sdq` command's start

    image_format = summary["options"]["format"]
    images_of = derived_from(summary["options"]) or summary["name"]
    data = store.get_bytes(shard_key(images_of, number))
    table = pq.read_table(io.BytesIO(data), columns=["key", "caption", image_format])
    return [
        {**row, "image": row.pop(image_format), "format": image_format}
        for row in table.to_pylist()
        if row["key"] in keys
    ]


def dataset_html(summary: dict[str, Any], samples: list[dict[str, Any]], sections: str) -> str:
    """The page, with the kinds' `sections` (HTML) after what every dataset shows."""
    done = sum(shard["done"] for shard in summary["shards"])
    line = (
        f"{summary['samples']:,} samples in {len(summary['shards'])} shards ({done} written, "
        f"{summary['bytes']:,} bytes)"
    )
    return PAGE.format(
        name=html.escape(summary["name"]),
        summary=html.escape(line),
        statuses=_rows(summary["by_status"]),
        reasons=_rows(summary["reasons"]) or '<tr><td colspan="2">none</td></tr>',
        made_of=_made_of(summary),
        sections=sections,
        samples="".join(sample_html(sample) for sample in samples),
    )


def _made_of(summary: dict[str, Any]) -> str:
    """What a dataset made of another's samples left out, by which rule."""
    if summary.get("removed") is None:
        return ""
    said = ", ".join(f"{rule} {bound}" for rule, bound in summary["filter"].items())
    return (f"<h2>Made of {html.escape(summary['made_of'])}: {html.escape(said)}</h2>"
            '<table class="removed"><thead><tr><th>left out by</th><th>samples</th>'
            f"</tr></thead><tbody>{_rows(summary['removed'])}</tbody></table>")  # fmt: skip


def _rows(counts: dict[str, int]) -> str:
    return "\n".join(
        f"<tr><td>{html.escape(str(name))}</td><td>{count:,}</td></tr>"
        for name, count in counts.items()
    )


def sample_html(sample: dict[str, Any]) -> str:
    data = base64.b64encode(sample["image"]).decode()
    caption = html.escape(sample["caption"] or "")
    return (
        f'<figure><img src="data:{MIME[sample["format"]]};base64,{data}" alt="{caption}">'
        f"<figcaption>{html.escape(sample['key'])}: {caption}</figcaption></figure>"
    )

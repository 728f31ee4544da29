"""`sdq evaluate --reference DATASET`: renders compared with a dataset's own images rather
than a run's held-out ones. Its first N kept samples are listed once in the store, in the
manifest a run's held-out samples have (key, caption, image shard), named by their content:
the same reference is the same spec, scored once, its real images' statistics kept."""

import io
from typing import Any

import click
from sqlalchemy import select
from sqlalchemy.orm import Session

from sdq.models.datasets import SampleStatus, derived_from, shard_key
from sdq.models.datasets.tables import Dataset, Sample, Shard
from sdq.models.evaluate.specs import HELD_OUT_COLUMNS, HeldOut
from sdq.models.specs import canonical_sha256
from sdq.models.store import PARQUET, ObjectStore
from sdq.producer.datasets.lookups import dataset_named


def reference_samples(
    session: Session, store: ObjectStore, name: str, samples: int
) -> tuple[HeldOut, list[str]]:
    """The dataset's first `samples` kept samples (by shard, then key) as held-out samples
    with no latents, and their captions."""
    dataset = dataset_named(session, name)
    kept = session.execute(
        select(Sample.key, Sample.caption, Shard.number)
        .join(Shard, Shard.id == Sample.shard_id)
        .where(Sample.dataset_id == dataset.id, Sample.status == SampleStatus.success)
        .order_by(Shard.number, Sample.key)
        .limit(samples)
    ).all()
    if not kept:
        raise click.UsageError(f"--reference {name}: the dataset has no kept samples")
    images_of = derived_from(dataset.options) or name
    options = dataset.options if images_of == name else session.scalar(
        select(Dataset.options).where(Dataset.name == images_of)
    )  # fmt: skip
    rows: dict[str, list[Any]] = {
        "latent_key": [None] * len(kept),  # no latents: the held-out loss is not asked
        "row": [None] * len(kept),
        "key": [key for key, _, _ in kept],
        "caption": [caption or "" for _, caption, _ in kept],
        "image_key": [shard_key(images_of, number) for _, _, number in kept],
        "image_format": [options["format"]] * len(kept),
    }
    return stored_manifest(store, name, rows), rows["caption"]


def stored_manifest(store: ObjectStore, name: str, rows: dict[str, list[Any]]) -> HeldOut:
    """Samples of dataset `name` that evaluations compare with (a reference, or a run's
    --eval-dataset), listed once in the store by their content: the same samples are the
    same spec, their real images' features computed once."""
    key = f"evaluate/references/{name}-{canonical_sha256(rows)[:16]}.parquet"
    if not store.exists(key):
        store.put_bytes(key, manifest_parquet(rows), content_type=PARQUET)
    return HeldOut(key=key, fraction=0.0, seed=0, samples=len(rows["key"]))


def manifest_parquet(rows: dict[str, list[Any]]) -> bytes:
    """A held-out manifest's columns (HELD_OUT_COLUMNS) as a parquet file."""
    import pyarrow as pa  # here: every `sdq` command imports the CLI, few evaluate
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.table({name: rows[name] for name in HELD_OUT_COLUMNS}), buffer,
                   compression="zstd")  # fmt: skip
    return buffer.getvalue()

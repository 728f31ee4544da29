"""What a download job writes to the database: duplicate claims while it works, and the
shard with all its samples once the shard file is stored."""

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from sdq.models.datasets.tables import Dataset, Sample, Shard
from sdq.models.db import chunked, copy_rows, upsert
from sdq.models.download.specs import SliceSpec
from sdq.models.download.tables import SampleClaim
from sdq.models.jobs.lifecycle import Output
from sdq.workers.download.shards import ShardRow

# Three bound parameters a claim: well under psycopg's and SQLite's limits.
CLAIMS_PER_STATEMENT = 5_000


def url_digest(url: str) -> str:
    return "url:" + hashlib.sha256(url.encode()).hexdigest()


def image_digest(sha256: str) -> str:
    return "image:" + sha256


def dataset_id(session: Session, name: str) -> int:
    return session.scalars(select(Dataset.id).where(Dataset.name == name)).one()


def claim(session: Session, dataset: int, digests: Mapping[str, str]) -> dict[str, str]:
    """Claims each digest for its sample key unless another sample holds it; returns, per
    key, the key that holds its digest (itself when it is first). Claiming again what a
    key already holds (a slice done twice) finds it its own. Chunks keep any shard size
    under the database's limit on bound parameters, in key order so "first" holds."""
    holders: dict[str, str] = {}
    for chunk in chunked(digests.items(), CLAIMS_PER_STATEMENT):
        rows = [{"dataset_id": dataset, "digest": d, "key": k} for k, d in chunk]
        session.execute(upsert(session, SampleClaim).on_conflict_do_nothing(), rows)
        holders.update(
            session.execute(
                select(SampleClaim.digest, SampleClaim.key).where(
                    SampleClaim.dataset_id == dataset,
                    SampleClaim.digest.in_({digest for _, digest in chunk}),
                )
            ).all()
        )
    return {key: holders[digest] for key, digest in digests.items()}


def record_shard(
    session: Session,
    dataset: int,
    spec: SliceSpec,
    rows: list[ShardRow],
    *,
    stored: Output,
    size: int,
    allowed_networks: Sequence[str],
    at: datetime,
) -> None:
    """Replaces whatever an earlier try of this slice wrote: a slice done twice leaves one
    set of samples."""
    shard = session.scalars(
        select(Shard.id).where(Shard.dataset_id == dataset, Shard.number == spec.shard)
    ).one()
    session.execute(delete(Sample).where(Sample.shard_id == shard))
    copy_rows(session, Sample.__table__, [_sample(dataset, shard, row) for row in rows])
    session.execute(
        update(Shard)
        .where(Shard.id == shard)
        .values(
            uri=stored.uri,
            sha256=stored.sha256,
            counts=dict(Counter(row.status for row in rows)),
            bytes=size,
            seconds=stored.work_seconds,
            finished_at=at,
            allowed_networks=list(allowed_networks),
        )
    )


def _sample(dataset: int, shard: int, row: ShardRow) -> dict[str, object]:
    return {
        "dataset_id": dataset,
        "shard_id": shard,
        "key": row.key,
        "url": row.url,
        "caption": row.caption,
        "status": row.status,
        "reason": row.error_message,
        "sha256": row.sha256,
        "width": row.width,
        "height": row.height,
        "original_width": row.original_width,
        "original_height": row.original_height,
    }

"""Questions about encodings, answered from the database: which latent shards a dataset
has, per model and resolution, and what each encode job covers."""

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from sdq.models.datasets import latent_prefix
from sdq.models.db import chunked
from sdq.models.jobs.kinds import ENCODE
from sdq.models.tables import Job
from sdq.models.tables.encode import LatentShard


def job_fields(session: Session, job_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Job id -> its dataset, image shard, model and resolution, from the job's spec."""
    found: dict[int, dict[str, Any]] = {}
    for chunk in chunked(job_ids):
        for job_id, spec in session.execute(
            select(Job.id, Job.spec).where(Job.id.in_(chunk), Job.kind == ENCODE.name)
        ):
            found[job_id] = {
                "dataset": spec["dataset"],
                "shard": spec["shard"],
                "model": spec["model_name"],
                "resolution": spec["resolution"],
            }
    return found


def latent_summary(session: Session, dataset_id: int, name: str) -> list[dict[str, Any]]:
    """The dataset's latent shards, one entry per model revision and resolution."""
    rows = session.execute(
        select(
            LatentShard.model_name,
            LatentShard.model_revision,
            LatentShard.resolution,
            func.count(),
            func.sum(LatentShard.samples),
            func.sum(LatentShard.seconds),
        )
        .where(LatentShard.dataset_id == dataset_id)
        .group_by(LatentShard.model_name, LatentShard.model_revision, LatentShard.resolution)
        .order_by(LatentShard.model_name, LatentShard.resolution)
    )
    return [
        {
            "model": model,
            "revision": revision,
            "resolution": resolution,
            "shards": shards,
            "samples": samples,
            "samples_per_second": round(samples / seconds, 2) if seconds else None,
            "prefix": latent_prefix(name, revision, resolution),
        }
        for model, revision, resolution, shards, samples, seconds in rows
    ]

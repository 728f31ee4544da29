"""The encode jobs' own fields, for the generic listings (a dataset's latents are the
datasets' own questions: producer/datasets/lookups.py)."""

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sdq.models.db import chunked
from sdq.models.jobs.kinds import ENCODE
from sdq.models.tables import Job


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

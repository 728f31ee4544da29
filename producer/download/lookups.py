"""The download jobs' own fields, for the generic listings."""

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sdq.models.db import chunked
from sdq.models.jobs.kinds import DOWNLOAD
from sdq.models.tables import Job


def job_fields(session: Session, job_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Job id -> its dataset, shard and the list rows it covers, from the job's spec."""
    found: dict[int, dict[str, Any]] = {}
    for chunk in chunked(job_ids):
        for job_id, spec in session.execute(
            select(Job.id, Job.spec).where(Job.id.in_(chunk), Job.kind == DOWNLOAD.name)
        ):
            found[job_id] = {
                "dataset": spec["dataset"],
                "shard": spec["shard"],
                "rows": f"{spec['first_row']}-{spec['first_row'] + spec['row_count'] - 1}",
            }
    return found

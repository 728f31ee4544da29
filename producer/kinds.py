"""What the generic commands (`status`, `show`, `runs`...) show of each kind of work: its
unit, from its row, and its jobs' own fields, from its ProducerHooks: `job_fields(session,
job_ids)` where they live in the kind's table, else `spec_fields(spec)` from each job's
spec."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sdq.models.db import chunked
from sdq.models.jobs.kinds import KINDS
from sdq.models.tables import Job

JobFields = Callable[[Session, Sequence[int]], dict[int, dict[str, Any]]]


@dataclass(frozen=True)
class KindViews:
    # What one job makes, in words: "images", "samples"...
    unit: str
    # Job id -> the kind's own fields for each job (a prompt and seed, a URL...).
    job_fields: JobFields


GENERIC = KindViews(unit="jobs", job_fields=lambda _session, _ids: {})


@cache
def views_of(kind: str) -> KindViews:
    if kind not in KINDS:
        return GENERIC
    row = KINDS[kind]
    hooks = row.producer_hooks()
    fields = hooks.job_fields or (
        _from_specs(kind, hooks.spec_fields) if hooks.spec_fields else GENERIC.job_fields
    )
    return KindViews(unit=row.unit, job_fields=fields)


def _from_specs(kind: str, spec_fields: Callable[[dict[str, Any]], dict[str, Any]]) -> JobFields:
    def job_fields(session: Session, job_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        found: dict[int, dict[str, Any]] = {}
        for chunk in chunked(job_ids):
            query = select(Job.id, Job.spec).where(Job.id.in_(chunk), Job.kind == kind)
            for job_id, spec in session.execute(query):
                found[job_id] = spec_fields(spec)
        return found

    return job_fields

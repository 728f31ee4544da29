"""Generation jobs as any writer of them writes them: `sdq submit`, and a train run's
validation renders. Each job is a jobs row (the outbox) and a generations row."""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from sdq.models.db import copy_rows, insert_rows
from sdq.models.jobs.kinds import GENERATE
from sdq.models.jobs.lifecycle import stored_outputs
from sdq.models.jobs.outbox import job_row
from sdq.models.specs import GenerationSpec
from sdq.models.tables import Job
from sdq.models.tables.generate import Generation


@dataclass(frozen=True, kw_only=True)
class PlannedJob:
    spec: GenerationSpec
    style: str | None
    source_line: int
    subject: str  # the row's prompt, before the style was crossed in


class BatchKeys(dict[tuple[Any, ...], str]):
    """Batch keys computed once per distinct setting: most rows of a run share one. The
    model's revision and scheduler name decide its scheduler config, the key's one
    unhashable part, so this tuple decides the key."""

    def of(self, spec: GenerationSpec) -> str:
        settings = (
            spec.model_revision,
            spec.model_source,
            spec.scheduler,
            spec.steps,
            spec.guidance,
            spec.width,
            spec.height,
            spec.dtype,
        )
        if settings not in self:
            self[settings] = spec.batch_key()
        return self[settings]


def insert_generation_jobs(
    session: Session, run_id: int, planned: list[PlannedJob], batch_keys: BatchKeys, now: datetime
) -> int:
    """Inserts one chunk; returns how many of its jobs were served from the cache."""
    # Messages take jobs in id order: ids in batch-key order make each message's jobs
    # share pipeline calls.
    keyed = sorted(((batch_keys.of(job.spec), job) for job in planned), key=lambda pair: pair[0])
    hashes = [job.spec.hash() for _, job in keyed]
    known = stored_outputs(session, hashes)
    rows = [
        job_row(run_id, GENERATE, job.spec.to_dict(), spec_hash, known.get(spec_hash), now)
        for (_, job), spec_hash in zip(keyed, hashes, strict=True)
    ]
    ids = insert_rows(session, Job.__table__, rows)
    copy_rows(
        session,
        Generation.__table__,
        [_generation_row(job_id, job, key) for job_id, (key, job) in zip(ids, keyed, strict=True)],
    )
    return sum(row["cached"] for row in rows)


def _generation_row(job_id: int, job: PlannedJob, batch_key: str) -> dict[str, Any]:
    spec = job.spec
    return {
        "job_id": job_id,
        "prompt": spec.prompt,
        "subject": job.subject,
        "style": job.style,
        "model": spec.model_name,
        "seed": spec.seed,
        "source_line": job.source_line,
        "batch_key": batch_key,
    }

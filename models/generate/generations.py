"""Generation jobs as any writer of them writes them: `sdq submit`, and a train run's
validation renders. Each job is a jobs row (the outbox) and a generations row."""

from dataclasses import dataclass
from datetime import datetime
from operator import itemgetter
from typing import Any

from sqlalchemy.orm import Session

from sdq.models.db import CopyText, copy_in, copy_rows, copy_text
from sdq.models.generate.specs import GenerationSpec
from sdq.models.generate.tables import Generation
from sdq.models.jobs.kinds import GENERATE
from sdq.models.jobs.lifecycle import utcnow
from sdq.models.jobs.outbox import (
    DrawnJobs,
    copy_drawn_jobs,
    draw_jobs,
    open_run,
    record_submitted,
    write_jobs,
)
from sdq.models.specs import CanonicalTemplate


@dataclass(frozen=True, kw_only=True)
class PlannedJob:
    spec: GenerationSpec
    style: str | None
    source_line: int
    subject: str  # the row's prompt, before the style was crossed in


class SharedSettings:
    """What a run's specs share, worked out once per distinct setting (most rows of a run
    have one): the batch key, and the spec hash's text around the values that vary from
    image to image. The model's revision and scheduler name decide its scheduler config,
    the settings' one unhashable part, so this tuple decides both."""

    PER_IMAGE = ("prompt", "negative_prompt", "seed")

    def __init__(self) -> None:
        self._known: dict[tuple[Any, ...], tuple[str, CanonicalTemplate]] = {}

    def key_and_hash(self, spec: GenerationSpec) -> tuple[str, str]:
        """spec.batch_key() and spec.hash(), without encoding the settings again."""
        settings = (
            spec.model_revision,
            spec.model_source,
            spec.scheduler,
            spec.steps,
            spec.guidance,
            spec.width,
            spec.height,
            spec.dtype,
            spec.safety_check,
            tuple(tuple(lora) for lora in spec.lora_identity()),
        )
        if settings not in self._known:
            template = CanonicalTemplate(spec.identity(), self.PER_IMAGE)
            self._known[settings] = (spec.batch_key(), template)
        batch_key, template = self._known[settings]
        return batch_key, template.sha256({name: getattr(spec, name) for name in self.PER_IMAGE})


@dataclass(frozen=True)
class Chunk:
    """Jobs ready to write, in batch-key order, with their batch keys, spec hashes and
    specs as stored. Worked out without the database, so a writer can do it while the
    database takes in the chunk before."""

    jobs: list[PlannedJob]
    batch_keys: list[str]
    hashes: list[str]
    specs: list[dict[str, Any]]


def prepare_chunk(planned: list[PlannedJob], settings: SharedSettings) -> Chunk:
    # Messages take jobs in id order: ids in batch-key order make each message's jobs
    # share pipeline calls.
    keyed = sorted(((*settings.key_and_hash(job.spec), job) for job in planned), key=itemgetter(0))
    jobs = [job for _, _, job in keyed]
    return Chunk(
        jobs=jobs,
        batch_keys=[batch_key for batch_key, _, _ in keyed],
        hashes=[spec_hash for _, spec_hash, _ in keyed],
        specs=[job.spec.to_dict() for job in jobs],
    )


def insert_generation_jobs(session: Session, run_id: int, chunk: Chunk, now: datetime) -> int:
    """Inserts one chunk with its first history rows; returns how many of its jobs were
    served from the cache."""
    written = write_jobs(session, run_id, GENERATE, chunk.specs, chunk.hashes, now)
    copy_rows(session, Generation.__table__, _generation_rows(written.ids, chunk))
    return written.cached


@dataclass(frozen=True)
class DrawnChunk:
    """A chunk made ready to copy in (Postgres) by a session beside the writer's: its jobs
    (outbox.draw_jobs) and their generations rows, formatted."""

    jobs: DrawnJobs
    generations: CopyText


def draw_chunk(session: Session, run_id: int, chunk: Chunk, now: datetime) -> DrawnChunk:
    """insert_generation_jobs' first step, which writes nothing (outbox.draw_jobs)."""
    jobs = draw_jobs(session, run_id, GENERATE, chunk.specs, chunk.hashes, now)
    rows = _generation_rows(jobs.ids, chunk)
    return DrawnChunk(jobs, copy_text(session, Generation.__table__, rows))


def copy_drawn_chunk(session: Session, run_id: int, chunk: DrawnChunk, now: datetime) -> int:
    """insert_generation_jobs of a drawn chunk, in the writer's transaction."""
    written = copy_drawn_jobs(session, run_id, chunk.jobs, now)
    copy_in(session, chunk.generations)
    return written.cached


def _generation_rows(job_ids: list[int], chunk: Chunk) -> list[dict[str, Any]]:
    return [
        _generation_row(job_id, job, key)
        for job_id, job, key in zip(job_ids, chunk.jobs, chunk.batch_keys, strict=True)
    ]


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


def open_render_run(
    session: Session, specs: list[GenerationSpec], *, source: str, options: dict[str, Any]
) -> int:
    """A generation run of fixed renders that another run asks for (a checkpoint's
    validation prompts, an evaluation's), its jobs in one message: written in the caller's
    transaction, each render served from the store when it exists. Returns its id."""
    planned = [
        PlannedJob(spec=spec, style=None, source_line=line, subject=spec.prompt)
        for line, spec in enumerate(specs, start=1)
    ]
    run = open_run(
        session,
        GENERATE,
        source=source,
        options=options,
        job_count=len(planned),
        jobs_per_message=len(planned),
        task_options={"batch_size": len(planned)},
    )
    cached = insert_generation_jobs(session, run.id, prepare_chunk(planned, SharedSettings()),
                                    utcnow())  # fmt: skip
    record_submitted(session, run.id, cached=cached)
    return run.id

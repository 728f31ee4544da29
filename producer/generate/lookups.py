"""Questions generation answers: prompts, styles, seeds, images; and `sdq find`, whose
listing by run or status alone holds jobs of every kind (a run's dead ones, whatever it does)."""

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import RowMapping, select
from sqlalchemy.orm import Session

from sdq.models.db import chunked
from sdq.models.generate.specs import image_key
from sdq.models.generate.tables import Generation
from sdq.models.jobs.kinds import GENERATE
from sdq.models.tables import Job, JobStatus, Run
from sdq.producer.errors import NotFound

FIELDS = (Generation.prompt, Generation.style, Generation.model, Generation.seed)


def job_fields(session: Session, job_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Job id -> its prompt, style, model and seed."""
    found: dict[int, dict[str, Any]] = {}
    for chunk in chunked(job_ids):
        query = select(Generation.job_id, *FIELDS).where(Generation.job_id.in_(chunk))
        for row in session.execute(query).mappings():
            found[row["job_id"]] = {column.name: row[column.name] for column in FIELDS}
    return found


def find_jobs(
    session: Session,
    *,
    prompt: str | None = None,
    style: str | None = None,
    model: str | None = None,
    run_id: int | None = None,
    status: str | None = None,
    limit: int = 50,
) -> list[dict[str, Any]]:
    """Substring matches, case-insensitive; the trigram index serves them on Postgres. By run
    or status alone, jobs of every kind (a run's dead ones, whatever it does); by prompt,
    style or model, generation jobs."""
    columns = (Job.id, Job.run_id, Job.kind, Job.status, Job.cached, Job.output_uri.label("uri"))
    query = (
        select(*columns, *FIELDS)
        .outerjoin(Generation, Generation.job_id == Job.id)
        .order_by(Job.id.desc())
        .limit(limit)
    )
    if prompt:
        query = query.where(Generation.prompt.ilike(f"%{_escape_like(prompt)}%", escape="\\"))
    if style:
        query = query.where(Generation.style.ilike(f"%{_escape_like(style)}%", escape="\\"))
    if model:
        query = query.where(Generation.model == model)
    if run_id is not None:
        query = query.where(Job.run_id == run_id)
    if status:
        query = query.where(Job.status == JobStatus(status))
    return _with_status_text(session.execute(query).mappings())


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def job_image_key(session: Session, job_id: int) -> str:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    if job.status != JobStatus.succeeded:
        raise NotFound(f"job {job_id} has no image: it is {job.status}")
    if job.output_uri is None:
        raise NotFound(f"job {job_id} has no image: the safety checker flagged it")
    return image_key(job.spec_hash)


def export_rows(session: Session, run_id: int) -> list[dict[str, Any]]:
    """What `sdq export` writes beside each image of a generation run: one row per
    succeeded job, in the run's order."""
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"no run {run_id}")
    if run.kind != GENERATE.name:
        raise NotFound(f"run {run_id} is a {run.kind} run: only generation runs have images")
    rows = session.execute(
        select(Job.id, Job.spec_hash, Job.spec, Generation.prompt, Generation.style,
               Generation.seed, Generation.source_line)
        .join(Generation, Generation.job_id == Job.id)
        .where(Job.run_id == run_id, Job.status == JobStatus.succeeded)
        .where(Job.output_uri.is_not(None))  # not the flagged, which have no image
        .order_by(Job.id)
    )  # fmt: skip
    return [
        {
            "job_id": job_id,
            "file_name": f"{spec_hash}.png",
            "prompt": prompt,
            "style": style,
            "seed": seed,
            "source_line": line,
            "model": spec["model_name"],
            "model_revision": spec["model_revision"],
            "steps": spec["steps"],
            "guidance": spec["guidance"],
            "width": spec["width"],
            "height": spec["height"],
            "spec_hash": spec_hash,
        }
        for job_id, spec_hash, spec, prompt, style, seed, line in rows
    ]


def _with_status_text(rows: Iterable[RowMapping]) -> list[dict[str, Any]]:
    return [{**row, "status": str(row["status"])} for row in rows]

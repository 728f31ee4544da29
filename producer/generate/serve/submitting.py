"""A request's run, as a submit makes one: its jobs written in one transaction (twins of
stored images served from the store as they are written), then sent on the generate kind's
lane (models/jobs/kinds.py). Plain, blocking code: the API runs it on its thread pool."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select

from sdq.models.generate.settings import GenerateSettings
from sdq.models.generate.specs import image_key
from sdq.models.jobs.kinds import GENERATE
from sdq.models.jobs.lifecycle import cancel_jobs
from sdq.models.jobs.outbox import EnqueueFailed, enqueue
from sdq.models.loras import resolve_lora
from sdq.models.registry import ModelNotFound, resolve_model
from sdq.models.store import StoreError
from sdq.models.tables import FINISHED, Job, JobStatus
from sdq.producer.generate.serve.requests import ImageRequest, Refusal, check_limits, planned_jobs
from sdq.producer.generate.submit import Batching, record_run
from sdq.workers.app import SdqCelery


@dataclass(frozen=True)
class Submitted:
    run_id: int
    job_ids: list[int]


class NotSent(Exception):
    """The broker did not take the request's messages: its jobs are cancelled, not left to
    render for nobody."""


def submit(
    app: SdqCelery, request: ImageRequest, *, key_name: str | None, default_model: str
) -> Submitted:
    """Checks the request, writes its run and jobs, and sends them; a problem before the
    send writes nothing."""
    settings = app.settings.group(GenerateSettings)
    size = check_limits(request, settings)
    model_name = request.model or default_model
    with app.sessions() as session:
        model = _named(
            "model",
            model_name,
            lambda: resolve_model(
                _not_a_path("model", model_name), store=app.store, session=session
            ),
        )
        loras = tuple(
            _named(
                "lora", value, lambda v=value: resolve_lora(_not_a_path("lora", v), session=session)
            )
            for value in request.lora
        )
    planned = planned_jobs(request, size=size, model=model, loras=loras)
    options: dict[str, Any] = {"api_key": key_name, "user": request.user, "model": model_name}
    submission = record_run(
        app.sessions,
        planned,
        model=model,
        source="api",
        options=options,
        # One pipeline call a message: a request is taken as soon as a worker is free.
        batching=Batching(batch_size=settings.batch_size, calls_per_task=1),
    )
    with app.sessions() as session:
        job_ids = session.scalars(
            select(Job.id).where(Job.run_id == submission.run_id).order_by(Job.id)
        ).all()
    return Submitted(submission.run_id, list(job_ids))


def send(app: SdqCelery, run_id: int) -> None:
    try:
        with app.sender(waited=True) as sender:
            enqueue(app.sessions, sender, run_id)
    except EnqueueFailed as error:
        with app.sessions.begin() as session:
            cancel_jobs(session, run_id)
        raise NotSent(str(error.__cause__)) from error


def _not_a_path(field: str, value: str) -> str:
    """Files of the server are not named over HTTP: a model or LoRA is a name, a hub id or
    an s3:// URI here."""
    if value.startswith(("/", ".", "~", "file:")) or Path(value).exists():
        raise Refusal(
            field,
            f"{value!r}: a path on the server is not taken over HTTP; name a model or LoRA "
            "(`sdq model push`), a hub id or an s3:// URI",
        )
    return value


def _named(field: str, value: str, resolve):
    try:
        return resolve()
    except (ModelNotFound, StoreError) as error:
        raise Refusal(field, f"{value!r}: {error}", status=404) from None
    except ValueError as error:
        raise Refusal(field, f"{value!r}: {error}") from None


def job_rows(app: SdqCelery, job_ids: list[int]) -> list[Job]:
    with app.sessions() as session:
        jobs = session.scalars(select(Job).where(Job.id.in_(job_ids)).order_by(Job.id)).all()
        session.expunge_all()
    return list(jobs)


def unsettled(app: SdqCelery, job_ids: list[int]) -> set[int]:
    """The jobs not finished yet (a job waiting for its retry is not)."""
    with app.sessions() as session:
        return set(
            session.scalars(
                select(Job.id).where(Job.id.in_(job_ids), Job.status.not_in(FINISHED))
            ).all()
        )


def job_of(app: SdqCelery, job_id: int) -> Job | None:
    jobs = job_rows(app, [job_id])
    return jobs[0] if jobs and jobs[0].kind == GENERATE.name else None


def stored_image(app: SdqCelery, spec_hash: str) -> str | None:
    """The store key of the image a spec hash names, where one was made."""
    with app.sessions() as session:
        found = session.scalars(
            select(Job.spec_hash)
            .where(
                Job.spec_hash == spec_hash,
                Job.status == JobStatus.succeeded,
                Job.output_uri.is_not(None),
            )
            .limit(1)
        ).first()
    return image_key(found) if found else None

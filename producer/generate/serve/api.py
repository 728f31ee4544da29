"""`sdq serve`: images on request over HTTP, in front of the same queues, database and store
as every other way in. Each request is a run with its jobs; the answer comes when the
workers' notices say the images exist (models/jobs/notices.py), or with 202 and the job ids
at SDQ_SERVE_WAIT_SECONDS; the jobs go on either way, and are cached."""

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any

import orjson
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.asyncio import Redis
from starlette.concurrency import run_in_threadpool

from sdq.migrations import ready
from sdq.models.generate.settings import GenerateSettings
from sdq.models.generate.specs import image_key
from sdq.models.jobs.notices import notices_url
from sdq.models.tables import FINISHED, Job, JobStatus
from sdq.producer.generate.serve import submitting
from sdq.producer.generate.serve.answers import (
    Answer,
    add_error_answers,
    error_answer,
    limit_body,
)
from sdq.producer.generate.serve.coalescing import Coalescer
from sdq.producer.generate.serve.figures import add_figures
from sdq.producer.generate.serve.keys import key_name
from sdq.producer.generate.serve.limits import Limits
from sdq.producer.generate.serve.requests import ImageRequest
from sdq.producer.generate.serve.settling import settling
from sdq.workers.app import SdqCelery

# An event stream says it is alive this often while its job has not settled.
KEEPALIVE_SECONDS = 15.0
# How long after its deadline an image no request waits for (or a request its dead replica
# never answered) stops counting as in flight.
FLIGHT_GRACE_SECONDS = 60.0


@dataclass(frozen=True)
class Service:
    app: SdqCelery
    redis: Redis
    limits: Limits
    coalescer: Coalescer
    settings: GenerateSettings
    default_model: str
    auth: bool


def create_api(app: SdqCelery, *, default_model: str, auth: bool = True) -> FastAPI:
    url = notices_url(app.settings)
    if url is None:
        raise ValueError(
            "sdq serve hears of finished images over Redis: SDQ_BROKER_URL must be a redis:// URL"
        )
    settings = app.settings.group(GenerateSettings)
    redis = Redis.from_url(url)
    limits = Limits(redis, settings.serve_requests_per_minute, settings.serve_images_in_flight)
    coalescer = Coalescer(
        partial(run_in_threadpool, submitting.send_together, app),
        window=settings.serve_batch_window_ms / 1000,
        call_size=settings.batch_size,
    )
    api = FastAPI(title="sdq", summary="Stable Diffusion images on request, queued and recorded")
    api.state.service = Service(app, redis, limits, coalescer, settings, default_model, auth)
    api.middleware("http")(limit_body)
    add_figures(api, redis, settings.serve_wait_seconds + FLIGHT_GRACE_SECONDS)
    add_error_answers(api)
    _add_routes(api)
    return api


def _service(request: Request) -> Service:
    return request.app.state.service


bearer = HTTPBearer(auto_error=False)


async def _caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> str | None:
    """The name of the caller's key (None where the service runs with --no-auth): 401
    without a valid one, 429 past its requests a minute."""
    service = _service(request)
    if not service.auth:
        return None
    name = credentials and await run_in_threadpool(_name_of, service.app, credentials.credentials)
    if name is None:
        raise Answer(
            401,
            "a valid API key is needed: `Authorization: Bearer KEY` (`sdq serve keys create "
            "NAME` makes one)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    await service.limits.take_request(name)
    return name


def _name_of(app: SdqCelery, key: str) -> str | None:
    with app.sessions() as session:
        return key_name(session, key)


Caller = Annotated[str | None, Depends(_caller)]


def _add_routes(api: FastAPI) -> None:
    api.get("/healthz", summary="Ready: the database and Redis answer")(healthz)
    api.post("/v1/images/generations", summary="Images, answered when they exist")(generations)
    api.post("/v1/jobs", status_code=202, summary="Images, answered at once with the jobs")(jobs)
    api.get("/v1/jobs/{job_id}", summary="A job's status, timings and image")(job)
    api.get("/v1/jobs/{job_id}/events", summary="A job's status as server-sent events")(events)
    api.get(
        "/v1/images/{spec_hash}.png",
        name="image",
        summary="An image by its spec hash",
        response_class=Response,
    )(image)


async def healthz(request: Request) -> Response:
    """Ready: Redis answers, and the database with its schema current."""
    service = _service(request)
    await service.redis.ping()
    if not await run_in_threadpool(ready, service.app.engine):
        return error_answer(503, "the database schema is not current: run `sdq db upgrade`")
    return JSONResponse({"ok": True})


async def generations(body: ImageRequest, request: Request, caller: Caller) -> Response:
    """OpenAI's images request, plus sdq's fields: the images once they exist (their URLs,
    or the PNGs' bytes with `response_format: b64_json`), else 202 with the jobs at
    SDQ_SERVE_WAIT_SECONDS, which go on."""
    service = _service(request)
    submitted, tokens = await _sent(service, body, caller)
    deadline = time.monotonic() + service.settings.serve_wait_seconds
    left = await _settled(service, caller, tokens, submitted.job_ids, deadline)
    if left:
        return JSONResponse(_pending(submitted, request), status_code=202)
    rows = await run_in_threadpool(submitting.job_rows, service.app, submitted.job_ids)
    failed = [job for job in rows if job.status is not JobStatus.succeeded]
    if failed:
        return error_answer(
            500,
            f"job {failed[0].id} {failed[0].status}: {failed[0].error}",
            **_pending(submitted, request),
        )
    data = [await _image(service, job, body.response_format, request) for job in rows]
    return JSONResponse({"created": int(time.time()), "data": data, **_pending(submitted, request)})


async def jobs(body: ImageRequest, request: Request, caller: Caller) -> dict[str, Any]:
    """The same request, answered as soon as its jobs are queued."""
    service = _service(request)
    submitted, tokens = await _sent(service, body, caller)
    if caller is not None:  # its room in flight is given back as its jobs settle
        deadline = time.monotonic() + service.settings.serve_wait_seconds
        _background(_settled(service, caller, tokens, submitted.job_ids, deadline))
    return _pending(submitted, request)


async def job(job_id: int, request: Request, caller: Caller) -> dict[str, Any]:
    return _job_view(await _job(request, job_id, caller), request)


async def events(job_id: int, request: Request, caller: Caller) -> StreamingResponse:
    """`queued`, `running`, then `done` or `failed` (each with the job's record), as they
    happen."""
    service = _service(request)
    await _job(request, job_id, caller)
    stream = _job_events(service, job_id, caller, request)
    return StreamingResponse(stream, media_type="text/event-stream")


async def image(spec_hash: str, request: Request) -> Response:
    """Asks for no key, as S3's presigned links do (the URLs answers give where the store
    is a local folder): its hash names it, and is known only to who knows its spec."""
    service = _service(request)
    key = await run_in_threadpool(submitting.stored_image, service.app, spec_hash)
    if key is None:
        raise Answer(404, f"no image with spec hash {spec_hash!r}", param="spec_hash")
    data = await run_in_threadpool(service.app.store.get_bytes, key)
    return Response(
        data,
        media_type="image/png",
        headers={"Cache-Control": "public, max-age=31536000, immutable"},
    )


async def _sent(
    service: Service, body: ImageRequest, caller: str | None
) -> tuple[submitting.Submitted, list[str]]:
    """The request checked, its images' room in flight taken for its key, then its run
    written and sent (the room given back where that fails); the tokens of that room."""
    checked = await run_in_threadpool(
        submitting.servable, service.app, body, default_model=service.default_model
    )
    tokens = []
    if caller is not None:
        until = time.time() + service.settings.serve_wait_seconds + FLIGHT_GRACE_SECONDS
        tokens = await service.limits.reserve(caller, body.n, until)
    try:
        submitted = await run_in_threadpool(
            submitting.submit, service.app, checked, key_name=caller
        )
        await _send(service, submitted)
    except BaseException:
        if caller is not None:
            await service.limits.release(caller, tokens)
        raise
    return submitted, tokens


async def _send(service: Service, submitted: submitting.Submitted) -> None:
    """The images not served from the store, to the workers: with others of the same
    pipeline call's settings where they fit in one call, else by themselves."""
    rendered = submitted.to_render
    if not rendered:
        return
    if service.coalescer.takes(len(rendered)):
        await service.coalescer.send(submitted.batch_key, submitted.run_id, rendered)
    else:
        await run_in_threadpool(submitting.send, service.app, submitted.run_id)


async def _settled(
    service: Service, caller: str | None, tokens: list[str], job_ids: list[int], deadline: float
) -> set[int]:
    """Waits for the jobs to settle (or the deadline); the room of those that did is given
    back. Returns those that did not."""
    async with settling(service.redis, job_ids) as heard:
        left = await heard.until(partial(_unsettled, service, job_ids), deadline)
    if caller is not None:
        await service.limits.release(caller, tokens[: len(job_ids) - len(left)])
    return left


async def _unsettled(service: Service, job_ids: list[int]) -> set[int]:
    return await run_in_threadpool(submitting.unsettled, service.app, job_ids)


# Waits that outlive their request (`POST /v1/jobs`), kept from the garbage collector.
_waits: set[asyncio.Task] = set()


def _background(wait) -> None:
    task = asyncio.get_running_loop().create_task(wait)
    _waits.add(task)
    task.add_done_callback(_waits.discard)


async def _job(request: Request, job_id: int, caller: str | None) -> Job:
    """The job, where the caller's key asked for it: 404 for any other."""
    found = await run_in_threadpool(submitting.job_of, _service(request).app, job_id, caller)
    if found is None:
        raise Answer(404, f"no generation job {job_id}", param="job_id")
    return found


async def _job_events(
    service: Service, job_id: int, caller: str | None, request: Request
) -> AsyncIterator[bytes]:
    """Each change of the job's state as an event, read from its row when its notices come
    (and between them, should one be lost), a comment between to keep the stream open."""
    said = None
    async with settling(service.redis, [job_id]) as heard:
        while True:
            job = await _job(request, job_id, caller)
            if (now := _state(job)) != said:
                yield _event(now, job, request)
                said = now
            if job.status in FINISHED:
                return
            if await heard.notice(KEEPALIVE_SECONDS) is None:
                yield b": still waiting\n\n"


def _state(job: Job) -> str:
    """A job's status as its events name it."""
    if job.status in FINISHED:
        return "done" if job.status is JobStatus.succeeded else "failed"
    return "running" if job.status is JobStatus.running else "queued"


def _event(name: str, job: Job, request: Request) -> bytes:
    return (
        b"event: " + name.encode() + b"\ndata: " + orjson.dumps(_job_view(job, request)) + b"\n\n"
    )


def _job_view(job: Job, request: Request) -> dict[str, Any]:
    made = job.status is JobStatus.succeeded and job.output_uri is not None
    return {
        "id": job.id,
        "run_id": job.run_id,
        "status": str(job.status),
        "spec_hash": job.spec_hash,
        "attempts": job.attempts,
        "cached": job.cached,
        "enqueued_at": job.enqueued_at and job.enqueued_at.isoformat(),
        "started_at": job.started_at and job.started_at.isoformat(),
        "finished_at": job.finished_at and job.finished_at.isoformat(),
        "setup_seconds": job.setup_seconds,
        "work_seconds": job.work_seconds,
        "error": job.error,
        "url": str(request.url_for("image", spec_hash=job.spec_hash)) if made else None,
    }


def _pending(submitted: submitting.Submitted, request: Request) -> dict[str, Any]:
    return {
        "run_id": submitted.run_id,
        "job_ids": submitted.job_ids,
        "jobs": [str(request.url_for("job", job_id=job_id)) for job_id in submitted.job_ids],
    }


async def _image(
    service: Service, job: Job, response_format: str, request: Request
) -> dict[str, Any]:
    """One image as OpenAI's answer gives it; one the safety checker flagged, said so."""
    if job.output_uri is None:
        return {"flagged": True, "job_id": job.id}
    if response_format == "b64_json":
        data = await run_in_threadpool(service.app.store.get_bytes, image_key(job.spec_hash))
        return {"b64_json": base64.b64encode(data).decode(), "job_id": job.id}
    return {"url": await _image_url(service, job, request), "job_id": job.id}


async def _image_url(service: Service, job: Job, request: Request) -> str:
    """A presigned link where the store is S3 (it serves the bytes itself; signed on the
    thread pool, as the first signing makes boto3's client), else this service's own."""
    if service.app.settings.store_url.startswith("s3://"):
        key = image_key(job.spec_hash)
        return await run_in_threadpool(service.app.store.link, key, expires_seconds=3600)
    return str(request.url_for("image", spec_hash=job.spec_hash))

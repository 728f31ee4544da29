"""The generate work: render a message's jobs in pipeline calls of shared settings, store
each image as a PNG that carries its spec. Plain code, no Celery; torch loads lazily."""

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING

from PIL.Image import Image
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.generate.specs import GenerationSpec, batches, image_key
from sdq.models.generate.tables import Generation
from sdq.models.jobs.delivery import Work
from sdq.models.jobs.lifecycle import Output
from sdq.models.store import ObjectStore
from sdq.models.tables import Job
from sdq.workers.generate.images import encode_png, sha256
from sdq.workers.weights import ModelUnavailable, PipelineError

if TYPE_CHECKING:
    from sdq.workers.generate.pipelines import PipelineCache

UPLOAD_THREADS = 8
# How often a call in hand asks whether a request waits (one LLEN on the broker's Redis).
GIVE_WAY_SECONDS = 0.05


def at_most_every(seconds: float, check: Callable[[], bool]) -> Callable[[], bool]:
    """`check`, asked again only once `seconds` have passed since it was last asked."""
    last = [perf_counter()]

    def throttled() -> bool:
        if perf_counter() - last[0] < seconds:
            return False
        last[0] = perf_counter()
        return check()

    return throttled


class GenerateWork(Work):
    # diffusers raises ValueError for arguments it cannot run (a size it cannot make);
    # everything else (store down, out of memory, time limit) may pass on another try.
    permanent_errors = (PipelineError, ModelUnavailable, ValueError)

    def __init__(
        self,
        *,
        store: ObjectStore,
        sessions: sessionmaker[Session],
        pipelines: "PipelineCache",
        batch_size: int,
        give_way: Callable[[], bool] = lambda: False,
    ):
        self.store = store
        self.sessions = sessions
        self.pipelines = pipelines
        self.batch_size = batch_size
        # Asked before each call and, at most every GIVE_WAY_SECONDS, between a call's steps:
        # whether work someone waits for is queued (a request on the lane), for which the
        # call in hand stops and the rest of this message is put back.
        self.give_way = give_way

    def run(self, jobs: Sequence[Job]) -> Iterator[Output]:
        """Renders call after call; a call's uploads run in threads while the next one
        renders, so the device never waits on the store. Before a call or between its steps,
        gives way to a request (`give_way`), leaving the rest of the message (`left`): a
        request waits for a step, not for a batch call."""
        from sdq.workers.generate.pipelines import GaveWay, render

        specs = {job.id: GenerationSpec.from_dict(job.spec) for job in jobs}
        by_id = {job.id: job for job in jobs}
        calls = batches([(job.id, specs[job.id].batch_key()) for job in jobs], self.batch_size)
        asked = at_most_every(GIVE_WAY_SECONDS, self.give_way)
        with ThreadPoolExecutor(UPLOAD_THREADS) as uploads:
            previous: list[Future[Output]] = []
            for index, call in enumerate(calls):
                try:
                    if self.give_way():
                        raise GaveWay
                    loaded, loading = self.pipelines.get(specs[call[0]])
                    started = perf_counter()
                    images = render(loaded, [specs[i] for i in call], give_way=asked)
                except GaveWay:
                    self.left = tuple(job_id for later in calls[index:] for job_id in later)
                    break
                # Each image's share of the call, and of the model load it waited for.
                timing = Timing(
                    setup=loading / len(call) if loading is not None else None,
                    work=(perf_counter() - started) / len(call),
                )
                flagged = self._flagged(call, specs, images)
                # The previous call's uploads had this call's rendering to finish in.
                yield from (upload.result() for upload in previous)
                yield from (Output(i, None, None, work_seconds=timing.work) for i in flagged)
                previous = [
                    uploads.submit(self._store, by_id[job_id], specs[job_id], image, timing)
                    for job_id, image in zip(call, images, strict=True)
                    if job_id not in flagged
                ]
            yield from (upload.result() for upload in previous)

    def _flagged(
        self, call: list[int], specs: dict[int, GenerationSpec], images: list[Image]
    ) -> set[int]:
        """The call's jobs whose image the safety checker flags, where their spec asks for
        it, recorded as flagged: each is done, with no image stored or kept."""
        checked = [
            (i, image) for i, image in zip(call, images, strict=True) if specs[i].safety_check
        ]
        if not checked:
            return set()
        checker = self.pipelines.safety_checker(specs[checked[0][0]])
        flags = checker.flagged([image for _, image in checked])
        flagged = {job_id for (job_id, _), flag in zip(checked, flags, strict=True) if flag}
        if flagged:
            with self.sessions.begin() as session:
                session.execute(
                    update(Generation).where(Generation.job_id.in_(flagged)).values(flagged=True)
                )
        return flagged

    def _store(self, job: Job, spec: GenerationSpec, image: Image, timing: "Timing") -> Output:
        data = encode_png(image, spec, job.spec_hash)
        uri = self.store.put_bytes(image_key(job.spec_hash), data, content_type="image/png")
        return Output(
            job.id,
            uri,
            sha256(data),
            work_seconds=timing.work,
            setup_seconds=timing.setup,
            units=1,
        )


@dataclass(frozen=True)
class Timing:
    setup: float | None
    work: float

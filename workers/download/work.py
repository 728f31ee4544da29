"""The download work: one slice of a list becomes one parquet shard and one sample row
per list row. Plain code, no Celery; runs on CPU workers, never imports torch."""

import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter

import pyarrow as pa
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.datasets import SampleStatus
from sdq.models.download.settings import DownloadSettings
from sdq.models.download.specs import SliceSpec
from sdq.models.jobs.delivery import Work
from sdq.models.jobs.lifecycle import Output, utcnow
from sdq.models.store import PARQUET, MissingObject, ObjectStore
from sdq.models.tables import Job
from sdq.workers.download.budget import PixelBudget
from sdq.workers.download.fetch import Fetcher, FetchFailed
from sdq.workers.download.images import ImageRejected, make_image
from sdq.workers.download.records import claim, dataset_id, image_digest, record_shard, url_digest
from sdq.workers.download.shards import ShardRow, read_shard_rows, read_slice, shard_bytes

log = logging.getLogger(__name__)


class ListUnreadable(Exception):
    """The slice's list (or, for a retry, its shard) is gone or not what was planned;
    another try will not help."""


class DownloadWork(Work):
    permanent_errors = (ListUnreadable,)

    def __init__(
        self,
        *,
        store: ObjectStore,
        sessions: sessionmaker[Session],
        fetcher: Fetcher,
        settings: DownloadSettings,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.fetcher = fetcher
        self.settings = settings
        # One process runs one slice at a time: its threads share this budget.
        self.budget = PixelBudget(settings.pixel_budget)

    def run(self, jobs: Sequence[Job]) -> Iterator[Output]:
        for job in jobs:
            yield self._download(job.id, SliceSpec.from_dict(job.spec))

    def _download(self, job_id: int, spec: SliceSpec) -> Output:
        started = perf_counter()
        with self.sessions() as session:
            dataset = dataset_id(session, spec.dataset)
        try:
            table = read_slice(spec)
        except (OSError, KeyError, ValueError, pa.ArrowException) as error:
            raise ListUnreadable(f"{spec.source_uri}: {error}") from error
        rows = self._samples(spec, dataset, table)
        data = shard_bytes(rows, spec.image.format, table.select(list(spec.columns.save)))
        uri = self.store.put_bytes(spec.shard_key, data, content_type=PARQUET)
        seconds = perf_counter() - started
        kept = sum(row.status == SampleStatus.success for row in rows)
        output = Output(
            job_id, uri, hashlib.sha256(data).hexdigest(), work_seconds=seconds, units=kept
        )
        with self.sessions.begin() as session:
            record_shard(
                session,
                dataset,
                spec,
                rows,
                stored=output,
                size=len(data),
                allowed_networks=self.settings.allow_networks,
                at=utcnow(),
            )
        return output

    def _samples(self, spec: SliceSpec, dataset: int, table: pa.Table) -> list[ShardRow]:
        urls = table.column(spec.columns.url).to_pylist()
        captions = table.column(spec.columns.caption).to_pylist()
        rows = [
            ShardRow(key=spec.sample_key(index), url=url or "", caption=caption)
            for index, (url, caption) in enumerate(zip(urls, captions, strict=True))
        ]
        for row in rows:
            if not row.url:
                _fail(row, "no url")
            elif not (row.caption or "").strip():
                _fail(row, "empty caption")
        if spec.previous_sha256:
            rows = self._keep_previous(spec, rows)
        self._mark_duplicates(dataset, rows, lambda row: url_digest(row.url))
        with ThreadPoolExecutor(self.settings.threads, thread_name_prefix="sdq-fetch") as pool:
            list(pool.map(lambda row: self._fetch(spec, row), rows))
        self._mark_duplicates(dataset, rows, lambda row: image_digest(row.sha256 or ""))
        return rows

    def _keep_previous(self, spec: SliceSpec, rows: list[ShardRow]) -> list[ShardRow]:
        """For a retry: every row not named for retrying, as the shard file has it."""
        try:
            data = self.store.get_bytes(spec.shard_key)
        except MissingObject as error:
            raise ListUnreadable(str(error)) from None
        if hashlib.sha256(data).hexdigest() != spec.previous_sha256:
            raise ListUnreadable(f"shard {spec.shard} changed since the retry was planned")
        previous = read_shard_rows(data, spec.image.format)
        retry = set(spec.retry_keys)
        return [row if row.key in retry else previous[row.key] for row in rows]

    def _fetch(self, spec: SliceSpec, row: ShardRow) -> None:
        """One row's fetch and image. Whatever goes wrong ends as this row's reason: an
        error nobody foresaw is logged, once, and the slice's other rows go on."""
        if row.status:
            return
        try:
            fetched = self.fetcher.fetch(row.url)
            image = make_image(
                fetched.data, spec.image, max_pixels=self.settings.max_pixels, budget=self.budget
            )
        except (FetchFailed, ImageRejected) as failure:
            _fail(row, failure.reason)
            return
        except Exception as error:
            log.exception("%s (%s): unexpected error", row.key, row.url)
            _fail(row, f"unexpected error: {type(error).__name__}")
            return
        row.status = SampleStatus.success
        row.sha256 = hashlib.sha256(fetched.data).hexdigest()
        row.image = image.data
        row.width, row.height = image.width, image.height
        row.original_width, row.original_height = image.original_width, image.original_height

    def _mark_duplicates(
        self, dataset: int, rows: list[ShardRow], digest: Callable[[ShardRow], str]
    ) -> None:
        """The first sample of the dataset with a URL (or picture) keeps it; any later one
        is a duplicate naming it, and keeps no image."""
        candidates = {
            row.key: digest(row) for row in rows if row.status in (None, SampleStatus.success)
        }
        with self.sessions.begin() as session:
            holders = claim(session, dataset, candidates)
        for row in rows:
            holder = holders.get(row.key, row.key)
            if holder != row.key:
                row.status = SampleStatus.duplicate
                row.error_message = f"duplicate of {holder}"
                row.image = None


def _fail(row: ShardRow, reason: str) -> None:
    row.status = SampleStatus.failed
    row.error_message = reason

"""The curate work: an image shard's kept samples scored by CLIP and the heads, their image
embeddings stored as a shard, their scores as rows. Plain code, no Celery; torch loads
lazily, on the first job.

As encode does, three stages overlap so the device never waits on the CPU: the next shard
file is read while this one is scored, the next batches are decoded and tokenized (on
threads) while this batch is on a GPU, and the device works in between. On the CPU, the
batches are decoded each in its turn (see `ahead_of_device`).
"""

import hashlib
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter
from typing import TYPE_CHECKING

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.ahead import run_ahead
from sdq.models.curate.specs import CurateSpec
from sdq.models.curate.tables import SampleScore
from sdq.models.datasets.tables import Dataset, Sample
from sdq.models.db import upsert
from sdq.models.jobs.delivery import Work
from sdq.models.jobs.lifecycle import Output, utcnow
from sdq.models.specs import canonical_sha256
from sdq.models.store import PARQUET, ObjectStore
from sdq.models.tables import Job
from sdq.workers.ahead import ahead_of_device
from sdq.workers.shards.embeddings import embedding_shard_bytes
from sdq.workers.shards.images import ImageShard, ShardUnreadable, fetch_image_shard
from sdq.workers.weights import ModelUnavailable

if TYPE_CHECKING:
    from sdq.workers.curate.scoring import LoadedScorers, Scores

BATCHES_AHEAD = 2
DECODE_THREADS = min(8, os.cpu_count() or 1)


class BadHeadFile(Exception):
    """A stored head is not a stack of linear layers: no attempt reads it otherwise."""


class CurateWork(Work):
    permanent_errors = (ShardUnreadable, ModelUnavailable, BadHeadFile)

    def __init__(
        self,
        *,
        store: ObjectStore,
        sessions: sessionmaker[Session],
        scorers: "LoadedScorers",
        batch_size: int,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.scorers = scorers
        self.batch_size = batch_size

    def run(self, jobs: Sequence[Job]) -> Iterator[Output]:
        specs = [CurateSpec.from_dict(job.spec) for job in jobs]
        shards = run_ahead((self._read(spec) for spec in specs), depth=1)
        with ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="sdq-decode") as decoders:
            for job, spec, shard in zip(jobs, specs, shards, strict=True):
                yield self._curate(job.id, spec, shard, decoders)

    def _read(self, spec: CurateSpec) -> ImageShard:
        return fetch_image_shard(
            self.store, spec.dataset, spec.shard, spec.shard_sha256, spec.image_format
        )

    def _curate(
        self, job_id: int, spec: CurateSpec, shard: ImageShard, decoders: ThreadPoolExecutor
    ) -> Output:
        """One image shard's embeddings stored and its samples' scores recorded."""
        from sdq.workers.curate.heads import BadHead
        from sdq.workers.curate.scoring import joined, prepare_batches, score_batch

        started = perf_counter()
        # 1. The shard's batches, decoded and tokenized ahead of the device, then scored.
        try:
            scorer = self.scorers.get(spec.scorer)
        except BadHead as error:
            raise BadHeadFile(str(error)) from None
        batches = prepare_batches(shard, scorer, batch_size=self.batch_size, decoders=decoders)
        batches = ahead_of_device(batches, BATCHES_AHEAD, scorer.device)
        scores = joined([score_batch(scorer, batch) for batch in batches],
                        width=scorer.model.config.projection_dim)  # fmt: skip
        # 2. The embeddings as a shard beside the images.
        about = {"dataset": spec.dataset, "shard": spec.shard, "image_sha256": spec.shard_sha256,
                 "model_revision": spec.model_revision}  # fmt: skip
        data = embedding_shard_bytes(shard.keys, scores.embeddings.astype(np.float16), about)
        uri = self.store.put_bytes(spec.embeddings_key, data, content_type=PARQUET)
        # 3. Every sample's scores; scoring a shard again rewrites its rows.
        with self.sessions.begin() as session:
            _record(session, spec, shard.keys, scores)
        return Output(job_id, uri, hashlib.sha256(data).hexdigest(),
                      work_seconds=perf_counter() - started, units=len(shard))  # fmt: skip


def scorer_hash(spec: CurateSpec) -> str:
    """What scored a sample: the CLIP model's revision and the heads' contents."""
    return canonical_sha256([spec.model_revision, spec.aesthetic_head, spec.nsfw_head])


def _record(session: Session, spec: CurateSpec, keys: list[str], scores: "Scores") -> None:
    dataset_id = session.scalar(select(Dataset.id).where(Dataset.name == spec.dataset))
    of_shard = select(Sample.key, Sample.id).where(
        Sample.dataset_id == dataset_id, Sample.key.in_(keys)
    )
    ids = dict(session.execute(of_shard).all())
    now, scorer = utcnow(), scorer_hash(spec)
    rows = [
        {
            "sample_id": ids[key],
            "dataset_id": dataset_id,
            "model_revision": spec.model_revision,
            "scorer": scorer,
            "clip_score": float(scores.clip_score[index]),
            "aesthetic": float(scores.aesthetic[index]) if scores.aesthetic is not None else None,
            "nsfw": float(scores.nsfw[index]) if scores.nsfw is not None else None,
            "scored_at": now,
        }
        for index, key in enumerate(keys)
    ]
    if not rows:
        return
    statement = upsert(session, SampleScore)
    changed = ("clip_score", "aesthetic", "nsfw", "scored_at")
    session.execute(
        statement.on_conflict_do_update(
            index_elements=["sample_id", "scorer"],
            set_={name: getattr(statement.excluded, name) for name in changed},
        ),
        rows,
    )

"""The encode work: an image shard becomes a latent shard and a lineage row. Plain code,
no Celery; torch loads lazily, on the first job.

Three stages overlap so the device never waits on the CPU: the next shard file is read
while this one is encoded, the next batches are decoded and tokenized (on threads) while
this batch is on a GPU, and the device works in between. On the CPU, the batches are
decoded each in its turn (see `ahead_of_device`).
"""

import hashlib
import io
import json
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlalchemy import delete, select, tuple_
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.ahead import run_ahead
from sdq.models.datasets import empty_pooled_key
from sdq.models.datasets.buckets import Bucket
from sdq.models.datasets.tables import Dataset, LatentSample, LatentShard, Sample, Shard
from sdq.models.db import copy_rows, upsert
from sdq.models.encode.specs import EncodeSpec
from sdq.models.jobs.delivery import Work
from sdq.models.jobs.lifecycle import Output, utcnow
from sdq.models.store import PARQUET, ObjectStore
from sdq.models.tables import Job
from sdq.workers.ahead import ahead_of_device
from sdq.workers.shards.images import ImageShard, ShardUnreadable, fetch_image_shard
from sdq.workers.shards.latents import Encoded, describe, latent_shard_bytes
from sdq.workers.weights import ModelUnavailable

if TYPE_CHECKING:
    from sdq.workers.encode.batches import Batch, TargetKey
    from sdq.workers.encode.encoders import Encoders, LoadedEncoders

NPY = "application/octet-stream"
JSON = "application/json"
# Batches prepared ahead of the device: enough to ride out a slow decode, few enough
# that pinned host memory stays small.
BATCHES_AHEAD = 2
# Decoding threads; Pillow decodes without the GIL, so these use the CPU's cores.
DECODE_THREADS = min(8, os.cpu_count() or 1)
# What names a latent shard (its unique constraint): encoding it again rewrites its row.
NAMED_BY = ("shard_id", "model_revision", "resolution", "bucketed", "width", "height")


@dataclass
class Made:
    """What a shard's batches made at one target: encoded parts, the shard's rows they
    are, and how many images were too small for it."""

    parts: list[Encoded] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    left_out: int = 0

    def add(self, encoded: Encoded, batch: "Batch", key: "TargetKey") -> None:
        self.parts.append(encoded)
        self.rows += batch.kept_rows(key)
        self.left_out += batch.targets[key].left_out


@dataclass(frozen=True)
class Stored:
    """A latent shard stored: its shape, where, its hash, and what it holds."""

    bucket: Bucket
    uri: str
    sha256: str
    samples: int
    too_small: int

    def described(self) -> dict[str, Any]:
        return {"uri": self.uri, "sha256": self.sha256, "samples": self.samples,
                "too_small": self.too_small}  # fmt: skip


class EncodeWork(Work):
    permanent_errors = (ShardUnreadable, ModelUnavailable)

    def __init__(
        self,
        *,
        store: ObjectStore,
        sessions: sessionmaker[Session],
        encoders: "LoadedEncoders",
        batch_size: int,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.encoders = encoders
        self.batch_size = batch_size

    def run(self, jobs: Sequence[Job]) -> Iterator[Output]:
        specs = [EncodeSpec.from_dict(job.spec) for job in jobs]
        shards = _by_shard(jobs, specs)
        images = run_ahead((self._read(targets[0][1]) for targets in shards), depth=1)
        with ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="sdq-decode") as decoders:
            for targets, shard in zip(shards, images, strict=True):
                yield from self._encode(targets, shard, decoders)

    def _read(self, spec: EncodeSpec) -> ImageShard:
        shard = fetch_image_shard(
            self.store, spec.images_of or spec.dataset, spec.shard, spec.shard_sha256,
            spec.image_format,
        )  # fmt: skip
        return shard if spec.keys is None else shard.only(spec.keys)

    def _encode(
        self,
        targets: list[tuple[int, EncodeSpec]],
        shard: ImageShard,
        decoders: ThreadPoolExecutor,
    ) -> Iterator[Output]:
        """One image shard's latents at each target, and its text embeddings, stored and
        recorded: each image decoded and each caption encoded once for all."""
        from sdq.workers.encode.batches import prepare_batches, square
        from sdq.workers.encode.encoders import encode_batch

        started = perf_counter()
        # 1. The shard's batches, decoded and tokenized ahead of the device, then encoded.
        specs = [spec for _, spec in targets]
        encoders = self.encoders.get(specs[0])
        batches = prepare_batches(shard, specs, encoders.tokenizers, batch_size=self.batch_size,
                                  decoders=decoders, conditioned=encoders.sdxl,
                                  pin=encoders.pins)  # fmt: skip
        # A square target has its latent shard though no image is kept; a bucket has one
        # once an image goes to it.
        made = {square(spec.resolution): Made() for spec in specs if not spec.buckets}
        for batch in ahead_of_device(batches, BATCHES_AHEAD, encoders.device):
            for key, encoded in encode_batch(encoders, batch).items():
                made.setdefault(key, Made()).add(encoded, batch, key)
        self._store_empty_prompt(specs[0], encoders)
        # 2. Each target's latent shards, sharing the time it took alike.
        seconds = (perf_counter() - started) / len(targets)
        yield from self._store_targets(targets, shard, made, seconds, encoders)

    def _store_targets(
        self,
        targets: list[tuple[int, EncodeSpec]],
        shard: ImageShard,
        made: dict["TargetKey", Made],
        seconds: float,
        encoders: "Encoders",
    ) -> Iterator[Output]:
        """Each target's latent shards of what the shard's batches made, and its output;
        the image shard's rows they point at, looked up once for all."""
        with self.sessions() as session:
            image = _image_rows(session, targets[0][1])
        for job_id, spec in targets:
            shapes = {key[1]: made[key] for key in made if key[0] == spec.resolution}
            each = seconds / max(1, len(shapes))  # a shard of no image has no bucket
            stored = [
                self._store(spec, shard, (bucket, of_shape), each, encoders, image)
                for bucket, of_shape in shapes.items()
            ]
            if spec.buckets:
                with self.sessions.begin() as session:
                    _forget_other_buckets(session, image.shard_id, spec, list(shapes))
            yield self._output(job_id, spec, stored, seconds)

    def _store(
        self,
        spec: EncodeSpec,
        shard: ImageShard,
        target: tuple[Bucket, "Made"],
        seconds: float,
        encoders: "Encoders",
        image: "ImageRows",
    ) -> "Stored":
        """A target's latent shard in one shape (its encoded samples, the shard's rows they
        are, and what it was made from) and its lineage rows, pointing at `image`'s."""
        from sdq.workers.encode.encoders import join

        bucket, made = target
        encoded = join(encoders, made.parts, bucket)
        lineage = {name: [column[n] for n in made.rows] for name, column in shard.lineage().items()}
        about = _made_from(spec, bucket, encoders.vae.config.scaling_factor)
        data = latent_shard_bytes(lineage, encoded, about)
        stored = Stored(
            bucket,
            self.store.put_bytes(spec.shape_key(bucket.name), data, content_type=PARQUET),
            hashlib.sha256(data).hexdigest(),
            samples=len(made.rows),
            too_small=made.left_out,
        )
        with self.sessions.begin() as session:
            _record(session, spec, image, stored, lineage["key"], tensors=describe(encoded),
                    seconds=seconds)  # fmt: skip
        return stored

    def _output(
        self, job_id: int, spec: EncodeSpec, stored: list["Stored"], seconds: float
    ) -> Output:
        """The job's output: its latent shard, or bucketed, a manifest of its buckets'."""
        samples = sum(shape.samples for shape in stored)
        if not spec.buckets:
            [only] = stored
            return Output(job_id, only.uri, only.sha256, work_seconds=seconds, units=samples)
        manifest = json.dumps(
            {shape.bucket.name: shape.described() for shape in stored}, sort_keys=True
        ).encode()
        uri = self.store.put_bytes(spec.latent_key, manifest, content_type=JSON)
        digest = hashlib.sha256(manifest).hexdigest()
        return Output(job_id, uri, digest, work_seconds=seconds, units=samples)

    def _store_empty_prompt(self, spec: EncodeSpec, encoders) -> None:
        """Training needs it whichever shard comes first: each worker process stores it
        once per dataset and model (the same bytes whoever writes it)."""
        from sdq.workers.encode.encoders import empty_prompt

        if spec.empty_prompt_key not in self.encoders.stored:
            embedding, pooled = empty_prompt(encoders)
            if pooled is not None:  # first: where the embedding is, its pooled one is too
                pooled_key = empty_pooled_key(spec.empty_prompt_key)
                self.store.put_bytes(pooled_key, npy_bytes(pooled), content_type=NPY)
            self.store.put_bytes(spec.empty_prompt_key, npy_bytes(embedding), content_type=NPY)
            self.encoders.stored.add(spec.empty_prompt_key)


def npy_bytes(array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _by_shard(jobs: Sequence[Job], specs: list[EncodeSpec]) -> list[list[tuple[int, EncodeSpec]]]:
    """The message's jobs as (job id, spec), those in a row that read the same images
    (one shard's resolutions) together."""
    shards: list[list[tuple[int, EncodeSpec]]] = []
    for job, spec in zip(jobs, specs, strict=True):
        if shards and shards[-1][0][1].source == spec.source:
            shards[-1].append((job.id, spec))
        else:
            shards.append([(job.id, spec)])
    return shards


@dataclass(frozen=True)
class ImageRows:
    """What a latent shard's lineage rows point at: its image shard's dataset and shard ids,
    and the shard's sample ids by key."""

    dataset_id: int
    shard_id: int
    samples: dict[str, int]


def _image_rows(session: Session, spec: EncodeSpec) -> ImageRows:
    dataset_id, shard_id = session.execute(
        select(Shard.dataset_id, Shard.id)
        .join(Dataset, Dataset.id == Shard.dataset_id)
        .where(Dataset.name == spec.dataset, Shard.number == spec.shard)
    ).one()
    samples = select(Sample.key, Sample.id).where(Sample.shard_id == shard_id)
    return ImageRows(dataset_id, shard_id, dict(session.execute(samples).all()))


def _forget_other_buckets(
    session: Session, shard_id: int, spec: EncodeSpec, buckets: list[Bucket]
) -> None:
    """A shard encoded again into other buckets (its file changed since) keeps no row of a
    bucket it no longer fills: training would read that bucket's old samples."""
    made = [(bucket.width, bucket.height) for bucket in buckets]
    session.execute(
        delete(LatentShard).where(
            LatentShard.shard_id == shard_id,
            LatentShard.model_revision == spec.model_revision,
            LatentShard.resolution == spec.resolution,
            LatentShard.bucketed.is_(True),
            tuple_(LatentShard.width, LatentShard.height).not_in(made),
        )
    )


def _record(
    session: Session,
    spec: EncodeSpec,
    image: ImageRows,
    stored: Stored,
    keys: Sequence[str],
    *,
    tensors: dict[str, Any],
    seconds: float,
) -> None:
    """The lineage rows: this latent file came from that image shard through that model, and
    its rows are the samples with those `keys`. Encoding a shard again (a redelivered job)
    rewrites them, never adds a second."""
    row = {
        "dataset_id": image.dataset_id,
        "shard_id": image.shard_id,
        "image_sha256": spec.shard_sha256,
        "model_name": spec.model_name,
        "model_revision": spec.model_revision,
        "resolution": spec.resolution,
        "bucketed": bool(spec.buckets),
        "width": stored.bucket.width,
        "height": stored.bucket.height,
        "uri": stored.uri,
        "sha256": stored.sha256,
        "samples": stored.samples,
        "too_small": stored.too_small,
        "rows_recorded": True,
        "tensors": tensors,
        "seconds": seconds,
        "finished_at": utcnow(),
    }
    rows = [image.samples[key] for key in keys]
    _record_samples(session, _upsert_latent_shard(session, row), rows)


def _upsert_latent_shard(session: Session, row: dict[str, Any]) -> int:
    """The latent shard's row, written or rewritten over the one that names the same shard;
    its id."""
    return session.execute(
        upsert(session, LatentShard)
        .values(row)
        .on_conflict_do_update(
            index_elements=NAMED_BY,
            set_={name: value for name, value in row.items() if name not in NAMED_BY},
        )
        .returning(LatentShard.id)
    ).scalar_one()


def _record_samples(session: Session, latent_shard_id: int, rows: Sequence[int]) -> None:
    """Which sample each of the latent shard's rows is, in place of what an earlier encoding
    of it recorded."""
    session.execute(delete(LatentSample).where(LatentSample.latent_shard_id == latent_shard_id))
    copy_rows(
        session,
        LatentSample.__table__,
        [{"latent_shard_id": latent_shard_id, "latent_row": row, "sample_id": sample_id}
         for row, sample_id in enumerate(rows)],
    )  # fmt: skip


def _made_from(spec: EncodeSpec, bucket: Bucket, scaling_factor: float) -> dict[str, Any]:
    """What a latent shard records of what made it."""
    return {
        "dataset": spec.dataset,
        "shard": spec.shard,
        "image_sha256": spec.shard_sha256,
        "model_revision": spec.model_revision,
        "resolution": spec.resolution,
        **({"bucket": {"width": bucket.width, "height": bucket.height}} if spec.buckets else {}),
        "scaling_factor": scaling_factor,
    }

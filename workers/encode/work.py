"""The encode work: an image shard becomes a latent shard and a lineage row. Plain code,
no Celery; torch loads lazily, on the first job.

Three stages overlap so the device never waits on the CPU: the next shard file is read
while this one is encoded, the next batches are decoded and tokenized (on threads) while
this batch is on a GPU, and the device works in between. On the CPU, the batches are
decoded each in its turn (see `ahead_of_device`).
"""

import hashlib
import io
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.ahead import run_ahead
from sdq.models.datasets.tables import Dataset, LatentShard, Shard
from sdq.models.db import upsert
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
    from sdq.workers.encode.encoders import LoadedEncoders

NPY = "application/octet-stream"
# Batches prepared ahead of the device: enough to ride out a slow decode, few enough
# that pinned host memory stays small.
BATCHES_AHEAD = 2
# Decoding threads; Pillow decodes without the GIL, so these use the CPU's cores.
DECODE_THREADS = min(8, os.cpu_count() or 1)


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
        """One image shard's latents at each target's resolution, and its text embeddings,
        stored and recorded: each image decoded and each caption encoded once for all."""
        from sdq.workers.encode.encoders import encode_batch, join, prepare_batches

        started = perf_counter()
        # 1. The shard's batches, decoded and tokenized ahead of the device, then encoded.
        specs = [spec for _, spec in targets]
        encoders = self.encoders.get(specs[0])
        batches = prepare_batches(
            shard,
            specs,
            encoders.tokenizer,
            batch_size=self.batch_size,
            decoders=decoders,
            pin=encoders.device.type == "cuda",
        )
        parts: list[dict[int, Encoded]] = []
        rows: dict[int, list[int]] = {spec.resolution: [] for spec in specs}
        for batch in ahead_of_device(batches, BATCHES_AHEAD, encoders.device):
            parts.append(encode_batch(encoders, batch))
            for resolution, kept in rows.items():
                kept += batch.kept_rows(resolution)
        self._store_empty_prompt(specs[0], encoders)
        # 2. Each target's latent shard, sharing the time it took alike.
        seconds = (perf_counter() - started) / len(targets)
        scaling = encoders.vae.config.scaling_factor
        for job_id, spec in targets:
            encoded = join(encoders, [part[spec.resolution] for part in parts], spec.resolution)
            about = _made_from(spec, scaling)
            yield self._store(job_id, spec, shard, (encoded, rows[spec.resolution], about), seconds)

    def _store(
        self,
        job_id: int,
        spec: EncodeSpec,
        shard: ImageShard,
        target: tuple[Encoded, list[int], dict[str, Any]],
        seconds: float,
    ) -> Output:
        """A target's latent shard (its encoded samples, the shard's rows they are, and
        what it was made from) and its lineage row."""
        encoded, rows, about = target
        lineage = {name: [column[n] for n in rows] for name, column in shard.lineage().items()}
        data = latent_shard_bytes(lineage, encoded, about)
        uri = self.store.put_bytes(spec.latent_key, data, content_type=PARQUET)
        output = Output(
            job_id, uri, hashlib.sha256(data).hexdigest(), work_seconds=seconds, units=len(rows)
        )
        with self.sessions.begin() as session:
            _record(session, spec, output, samples=len(rows), too_small=len(shard) - len(rows),
                    tensors=describe(encoded))  # fmt: skip
        return output

    def _store_empty_prompt(self, spec: EncodeSpec, encoders) -> None:
        """Training needs it whichever shard comes first: each worker process stores it
        once per dataset and model (the same bytes whoever writes it)."""
        from sdq.workers.encode.encoders import empty_prompt

        if spec.empty_prompt_key not in self.encoders.stored:
            self.store.put_bytes(
                spec.empty_prompt_key, npy_bytes(empty_prompt(encoders)), content_type=NPY
            )
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


def _record(
    session: Session,
    spec: EncodeSpec,
    output: Output,
    *,
    samples: int,
    too_small: int,
    tensors: dict[str, Any],
) -> None:
    """The lineage row: this latent file came from that image shard through that model.
    Encoding a shard again (a redelivered job) rewrites the row, never adds a second."""
    dataset_id, shard_id = session.execute(
        select(Shard.dataset_id, Shard.id)
        .join(Dataset, Dataset.id == Shard.dataset_id)
        .where(Dataset.name == spec.dataset, Shard.number == spec.shard)
    ).one()
    row = {
        "dataset_id": dataset_id,
        "shard_id": shard_id,
        "image_sha256": spec.shard_sha256,
        "model_name": spec.model_name,
        "model_revision": spec.model_revision,
        "resolution": spec.resolution,
        "uri": output.uri,
        "sha256": output.sha256,
        "samples": samples,
        "too_small": too_small,
        "tensors": tensors,
        "seconds": output.work_seconds,
        "finished_at": utcnow(),
    }
    key = ["shard_id", "model_revision", "resolution"]
    session.execute(
        upsert(session, LatentShard)
        .values(row)
        .on_conflict_do_update(
            index_elements=key, set_={name: value for name, value in row.items() if name not in key}
        )
    )


def _made_from(spec: EncodeSpec, scaling_factor: float) -> dict[str, Any]:
    """What a latent shard records of what made it."""
    return {
        "dataset": spec.dataset,
        "shard": spec.shard,
        "image_sha256": spec.shard_sha256,
        "model_revision": spec.model_revision,
        "resolution": spec.resolution,
        "scaling_factor": scaling_factor,
    }

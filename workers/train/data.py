"""The samples a train run sees, in a seeded shuffled order: one epoch after another, the
latent shards in a permuted order and each shard's rows permuted within it. Batch k is
samples [k * batch_size, (k + 1) * batch_size) of that endless stream, so a job that
starts at step s starts at sample s * batch_size, on any worker, with nothing saved but
the step. With several ranks, each reads its own equal slice of every batch. No torch
here."""

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from itertools import islice

import numpy as np
import pyarrow.parquet as pq

from sdq.models.training import LatentInput
from sdq.workers.shards.latents import read_tensor


@dataclass(frozen=True)
class Batch:
    latents: np.ndarray  # batch x channels x height x width, float32
    text_embeddings: np.ndarray  # batch x tokens x hidden size, float32


class LatentStream:
    def __init__(
        self,
        inputs: tuple[LatentInput, ...],
        *,
        seed: int,
        batch_size: int,
        read: Callable[[str], bytes],
    ) -> None:
        self.inputs = inputs
        self.seed = seed
        self.batch_size = batch_size
        self.total = sum(item.samples for item in inputs)
        # The shard being read and the next: shards come one at a time in this order.
        self._shard = lru_cache(maxsize=2)(lambda index: _load(read(inputs[index].key)))

    def samples(self, first_step: int) -> Iterator[tuple[int, int]]:
        """(shard index, row) of every sample from the first one step `first_step` sees."""
        epoch, offset = divmod(first_step * self.batch_size, self.total)
        while True:
            yield from self._epoch(epoch, offset)
            epoch, offset = epoch + 1, 0

    def _epoch(self, epoch: int, offset: int) -> Iterator[tuple[int, int]]:
        # A generator per shard: skipping to an offset draws nothing for the shards before.
        for shard in np.random.default_rng([self.seed, epoch]).permutation(len(self.inputs)):
            size = self.inputs[shard].samples
            if offset >= size:
                offset -= size
                continue
            rows = np.random.default_rng([self.seed, epoch, int(shard)]).permutation(size)
            for row in rows[offset:]:
                yield int(shard), int(row)
            offset = 0

    def batches(self, first_step: int, part: slice = slice(None)) -> Iterator[Batch]:
        """Batch after batch from the one step `first_step` trains on: of each, the samples
        in `part` (a rank's share)."""
        samples = self.samples(first_step)
        while True:
            yield self._batch(list(islice(samples, self.batch_size))[part])

    def _batch(self, samples: list[tuple[int, int]]) -> Batch:
        latents, embeddings = [], []
        for shard, row in samples:
            shard_latents, shard_embeddings = self._shard(shard)
            latents.append(shard_latents[row])
            embeddings.append(shard_embeddings[row])
        return Batch(np.stack(latents), np.stack(embeddings))


def _load(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    table = pq.read_table(io.BytesIO(data), columns=["latents", "text_embeddings"])
    return (
        read_tensor(table, "latents").astype(np.float32),
        read_tensor(table, "text_embeddings").astype(np.float32),
    )

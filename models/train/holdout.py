"""The held-out part of a run's data (`--holdout FRACTION`): samples chosen by sample, from
the run's seed and each latent shard's key, that training never reads and evaluation's
held-out loss and real images come from. The same rows on any worker and at any world
size, with nothing stored but the fraction and the seed."""

import zlib
from collections.abc import Sequence

import numpy as np

from sdq.models.train.specs import LatentInput

# Keeps the held-out draw apart from the run's other draws from the same seed.
HOLDOUT_STREAM = 0x401D


def held_out(key: str, samples: int, fraction: float, seed: int) -> np.ndarray:
    """Which of the `samples` rows of the latent shard stored at `key` are held out: each
    with probability `fraction`."""
    if not fraction:
        return np.zeros(samples, dtype=bool)
    draw = np.random.default_rng([seed, HOLDOUT_STREAM, zlib.crc32(key.encode())])
    return draw.random(samples) < fraction


def kept_rows(key: str, samples: int, fraction: float, seed: int) -> np.ndarray:
    """The rows of the shard that training reads, in order."""
    return np.flatnonzero(~held_out(key, samples, fraction, seed))


def first_held_out(
    inputs: Sequence[LatentInput], fraction: float, seed: int, samples: int
) -> list[tuple[int, np.ndarray]]:
    """The first `samples` held-out samples in the order of the run's latent shards, as
    (the shard's place in the inputs, its held-out rows)."""
    picked: list[tuple[int, np.ndarray]] = []
    left = samples
    for index, item in enumerate(inputs):
        if left <= 0:
            break
        rows = np.flatnonzero(held_out(item.key, item.samples, fraction, seed))[:left]
        if len(rows):
            picked.append((index, rows))
            left -= len(rows)
    return picked

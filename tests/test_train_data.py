"""The train data path on the CPU: the latent shard format (the binary layout read as views,
the list layout of earlier shards still read), and the stream of samples: the order of
earlier runs with one lane, ranks that read only their own lanes' shards and together
train on what one rank does, jobs that start mid-run, and every sample once per epoch."""

import io
from collections import Counter
from itertools import islice

import numpy as np
import pyarrow.parquet as pq
import pytest

from sdq.models.train.holdout import held_out
from sdq.models.train.specs import LatentInput, TrainOptions, default_lanes
from sdq.workers.shards.latents import Encoded, latent_shard_bytes, read_training_tensors
from sdq.workers.train.loop.data import LatentStream
from tests.old_shards import list_layout_bytes
from tests.services import wait_for


def encoded(samples: int, seed: int = 0) -> Encoded:
    rng = np.random.default_rng(seed)
    return Encoded(
        seeds=list(range(samples)),
        latents=rng.standard_normal((samples, 4, 8, 8)).astype(np.float16),
        text_embeddings=rng.standard_normal((samples, 7, 32)).astype(np.float16),
        token_ids=rng.integers(0, 1000, (samples, 7)),
    )


def test_a_shard_s_tensors_read_back_as_views_in_their_dtype_and_old_shards_still_read() -> None:
    tensors = encoded(5)
    lineage = {"key": [f"{n:04d}" for n in range(5)], "url": ["u"] * 5}
    data = latent_shard_bytes(lineage, tensors, {"dataset": "d"})
    tensors_read = read_training_tensors(data)
    latents, embeddings = tensors_read["latents"], tensors_read["text_embeddings"]
    np.testing.assert_array_equal(latents, tensors.latents)
    np.testing.assert_array_equal(embeddings, tensors.text_embeddings)
    assert latents.dtype == embeddings.dtype == np.float16
    # Views of the column's one copy, not arrays converted element by element.
    assert not latents.flags.owndata and not embeddings.flags.owndata
    columns = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0)
    compression = {columns.column(i).path_in_schema: columns.column(i).compression
                   for i in range(columns.num_columns)}  # fmt: skip
    assert compression["latents"] == "UNCOMPRESSED" and compression["key"] == "ZSTD"
    old = read_training_tensors(list_layout_bytes(tensors))
    old_latents, old_embeddings = old["latents"], old["text_embeddings"]
    np.testing.assert_array_equal(old_latents, tensors.latents)
    np.testing.assert_array_equal(old_embeddings, tensors.text_embeddings)


SIZES = (5, 7, 6, 3, 8, 5, 4, 6)


def inputs(sizes=SIZES) -> tuple[LatentInput, ...]:
    return tuple(
        LatentInput(uri=f"s3://b/{n}", key=str(n), samples=size) for n, size in enumerate(sizes)
    )


class Shards:
    """Shards whose latents say which (shard, row) they are, and which shards were loaded."""

    def __init__(self, sizes=SIZES) -> None:
        self.sizes = sizes
        self.loaded: list[int] = []

    def load(self, index: int) -> dict[str, np.ndarray]:
        self.loaded.append(index)
        rows = np.arange(self.sizes[index])
        ids = (index * 1000 + rows).astype(np.float32)
        return {"latents": ids[:, None, None, None], "text_embeddings": ids[:, None, None]}


def samples(stream: LatentStream, steps: int, first_step: int = 0, lanes=None) -> list[list[int]]:
    """Each batch's samples as shard * 1000 + row."""
    batches = stream.batches(first_step, lanes)
    return [[int(v) for v in batch.latents.reshape(-1)] for batch in islice(batches, steps)]


def stream(shards: Shards, *, lanes: int, batch_size: int = 4, ahead: int = 0, sizes=SIZES):
    return LatentStream(inputs(sizes), seed=7, batch_size=batch_size, lanes=lanes,
                        load=shards.load, shards_ahead=ahead, threads=2)  # fmt: skip


def earlier_order(seed: int, sizes, batch_size: int, steps: int) -> list[list[int]]:
    """The order of runs from before data lanes, as that code drew it: each epoch's shards
    permuted, each shard's rows permuted, batch after batch."""
    order = []
    for epoch in range(10):
        for shard in np.random.default_rng([seed, epoch]).permutation(len(sizes)):
            rows = np.random.default_rng([seed, epoch, int(shard)]).permutation(sizes[shard])
            order += [int(shard) * 1000 + int(row) for row in rows]
    return [order[k * batch_size : (k + 1) * batch_size] for k in range(steps)]


def test_one_lane_keeps_the_order_of_earlier_runs_from_any_step() -> None:
    expected = earlier_order(7, SIZES, batch_size=4, steps=40)
    assert samples(stream(Shards(), lanes=1), 40) == expected
    assert samples(stream(Shards(), lanes=1), 15, first_step=25) == expected[25:]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_fetch_only_their_lanes_shards_and_together_train_what_one_rank_does(
    world_size: int,
) -> None:
    lanes, steps, sizes = 4, 10, (6,) * 8  # 40 samples: within the first epoch of 48
    alone = Shards(sizes)
    whole = samples(stream(alone, lanes=lanes, sizes=sizes), steps)
    parts, fetched = [], []
    share = lanes // world_size
    for rank in range(world_size):
        shards = Shards(sizes)
        mine = range(rank * share, (rank + 1) * share)
        parts.append(samples(stream(shards, lanes=lanes, sizes=sizes), steps, lanes=mine))
        fetched.append(shards.loaded)
    # Rank r's part of every batch is its slice of the one rank's batch, in order.
    together = [[value for part in batch for value in part] for batch in zip(*parts, strict=True)]
    assert together == whole
    # Within an epoch no shard is fetched by two ranks, and none more than once.
    assert sum(len(loaded) for loaded in fetched) == len(alone.loaded) == len(set(alone.loaded))
    assert len(set().union(*fetched)) == len(alone.loaded)


def test_a_job_that_starts_mid_run_goes_on_with_the_same_samples() -> None:
    expected = samples(stream(Shards(), lanes=4, ahead=2), 60)
    assert samples(stream(Shards(), lanes=4, ahead=2), 23, first_step=37) == expected[37:]


def test_every_sample_once_per_epoch_over_lanes() -> None:
    sizes = (6,) * 8  # lanes end their epochs together
    batches = samples(stream(Shards(sizes), lanes=4, sizes=sizes), 2 * 48 // 4)
    for epoch in (batches[:12], batches[12:]):
        seen = Counter(value for batch in epoch for value in batch)
        assert set(seen.values()) == {1} and len(seen) == 48


def test_fewer_shards_than_lanes_still_fill_every_lane() -> None:
    sizes = (5,)
    shards = Shards(sizes)
    batches = samples(stream(shards, lanes=4, sizes=sizes), 10)
    assert all(len(batch) == 4 for batch in batches)
    # Each lane reads the one shard in its own epoch's row order.
    assert Counter(value for batch in batches for value in batch) == Counter(
        {row: 8 for row in range(5)}
    )


def test_default_lanes_are_the_same_for_one_to_eight_ranks() -> None:
    lanes = {world: TrainOptions(steps=1, batch_size=64, world_size=world).data_lanes
             for world in (1, 2, 4, 8)}  # fmt: skip
    assert set(lanes.values()) == {8}
    assert default_lanes(6, 1) == 6 and default_lanes(12, 1) == 6 and default_lanes(32, 16) == 16
    with pytest.raises(ValueError, match="--data-lanes 3 must divide --batch-size 8"):
        TrainOptions(steps=1, batch_size=8, data_lanes=3)
    with pytest.raises(ValueError, match="multiple of --world-size 4"):
        TrainOptions(steps=1, batch_size=8, world_size=4, data_lanes=2)


@pytest.mark.parametrize("ahead", [1, 3])
def test_a_run_reads_ahead_but_nothing_past_its_last_step(ahead: int) -> None:
    """Shards are fetched ahead of the steps that need them, yet a run bounded by its last
    step fetches the shards its steps take and no other: a lane whose last piece ends with
    the run left a shard fetched for nobody (one a lane, once a run: 4.6% of a rank's bytes
    at 8 ranks of a run of two epochs in benchmarks/train_data.py)."""
    sizes = (6,) * 8
    shards = Shards(sizes)
    steps = 6  # a sample a lane a step: each of the 4 lanes' first shard, exactly
    taken = stream(shards, lanes=4, batch_size=4, ahead=ahead, sizes=sizes).batches(
        0, last_step=steps
    )
    used = {value // 1000 for batch in taken for value in batch.latents.reshape(-1)}
    assert len(used) == 4
    assert sorted(set(shards.loaded)) == sorted(used)
    unbounded = Shards(sizes)
    samples(stream(unbounded, lanes=4, batch_size=4, ahead=ahead, sizes=sizes), steps)
    # With no last step, it reads ahead past the steps it was asked for (on its threads).
    wait_for(lambda: len(set(unbounded.loaded)) > 4, what="shards read ahead", timeout=10)


def test_held_out_samples_are_never_trained_on_and_ranks_still_train_what_one_does() -> None:
    sizes = (6,) * 8
    every = {n * 1000 + row for n, size in enumerate(sizes) for row in range(size)}
    held = {n * 1000 + int(row) for n, size in enumerate(sizes)
            for row in np.flatnonzero(held_out(str(n), size, 0.25, 7))}  # fmt: skip
    assert 0 < len(held) < len(every) / 2

    def held_stream(shards: Shards) -> LatentStream:
        return LatentStream(inputs(sizes), seed=7, batch_size=4, lanes=4, load=shards.load,
                            shards_ahead=1, threads=2, holdout=0.25)  # fmt: skip

    trained = samples(held_stream(Shards(sizes)), 40)  # over three epochs of what is kept
    assert set().union(*map(set, trained)) == every - held
    parts = [samples(held_stream(Shards(sizes)), 40, lanes=range(r * 2, r * 2 + 2)) for r in (0, 1)]
    assert [a + b for a, b in zip(*parts, strict=True)] == trained
    # Holding out nothing is the run as it was.
    assert samples(stream(Shards(sizes), lanes=4, sizes=sizes), 40) == samples(
        LatentStream(inputs(sizes), seed=7, batch_size=4, lanes=4, load=Shards(sizes).load,
                     shards_ahead=0, threads=2, holdout=0.0), 40
    )  # fmt: skip

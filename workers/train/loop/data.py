"""The samples a train run sees, in a seeded order that any number of ranks reads apart.

The run's latent shards are dealt to its data lanes (`--data-lanes`): each epoch's seeded
permutation of the shards, one epoch after another, is dealt round the lanes like cards,
and each lane reads its shards one after another, each shard's rows in a seeded order.
Global batch k takes the next batch_size / lanes samples of every lane, lane by lane, so a
job that starts at step s starts every lane at sample s * batch_size / lanes, on any
worker, with nothing saved but the step.

A rank trains on whole lanes (the world size divides the lanes), which are its slice of
every global batch: it fetches only its lanes' shards, about 1/N of the bytes, and N ranks
train on exactly what one rank would with the same lanes. With one lane this is the order
of earlier runs: each epoch's shards in their permuted order, each shard's rows permuted.

A rank's next shards are known from the seed: they are fetched and decoded on a pool of
threads (parallel ranged GETs on S3) while the current ones are trained on.

On aspect-ratio buckets (`--buckets`), each bucket's shards are a stream of their own as
above, and each global batch is one bucket's: the bucket of step k is drawn from the run's
seed in proportion to the buckets' samples, in blocks of steps, so a job that starts at
step s counts each bucket's steps before it from the seed alone and starts every bucket's
lanes there. No torch here.
"""

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import count

import numpy as np

from sdq.models.train.holdout import kept_rows
from sdq.models.train.specs import LatentInput
from sdq.workers.shards.latents import read_training_tensors

# Fetches one shard's tensors (read_training_tensors), by its place in the run's inputs.
Tensors = dict[str, np.ndarray]
LoadShard = Callable[[int], Tensors]
# Where a batch's arrays are gathered: (shape, dtype) -> an empty array (pinned memory
# on a GPU, so the copy to the device runs without the host waiting).
Allocate = Callable[[tuple[int, ...], np.dtype], np.ndarray]


@dataclass(frozen=True)
class Batch:
    step: int  # the step that trains on it, counted from 1
    latents: np.ndarray  # this rank's samples x channels x height x width, as stored
    text_embeddings: np.ndarray  # this rank's samples x tokens x hidden size, as stored
    bucket: str | None = None  # its aspect-ratio bucket, WIDTHxHEIGHT, on buckets
    # An SDXL U-Net's added conditions (pooled embeddings, time ids), by diffusers' names.
    added: Tensors = field(default_factory=dict)


@dataclass(frozen=True)
class Piece:
    """One shard a lane reads, and its rows in the order the lane takes them."""

    shard: int
    rows: np.ndarray


def _share(count: int, *, seed: int, lanes: int, lane: int, epoch: int) -> np.ndarray:
    """A lane's shards of one epoch: every `lanes`-th of its permutation, starting where the
    deal of the epochs before left off."""
    order = np.random.default_rng([seed, epoch]).permutation(count)
    return order[(lane - epoch * count) % lanes :: lanes]


def lane_pieces(
    inputs: tuple[LatentInput, ...],
    *,
    seed: int,
    lanes: int,
    lane: int,
    offset: int,
    kept: Sequence[np.ndarray] | None = None,
) -> Iterator[Piece]:
    """The pieces of a lane from its sample `offset` on, of each shard only its `kept` rows
    (all of them by default: none held out). Whole epochs and shards before the offset are
    skipped by their sizes: nothing is drawn for them."""
    sizes = np.array([len(rows) for rows in kept] if kept else [item.samples for item in inputs])
    deal = partial(_share, len(inputs), seed=seed, lanes=lanes, lane=lane)
    first = 0
    while offset >= (epoch_samples := int(sizes[deal(epoch=first)].sum())):
        offset -= epoch_samples
        first += 1
    for epoch in count(first):
        for shard in map(int, deal(epoch=epoch)):
            if offset >= sizes[shard]:
                offset -= int(sizes[shard])
                continue
            rows = np.random.default_rng([seed, epoch, shard]).permutation(sizes[shard])
            yield Piece(shard, (kept[shard][rows] if kept else rows)[offset:])
            offset = 0


class Lane:
    """A lane's samples as a rank takes them, with its next shards in view."""

    def __init__(self, pieces: Iterator[Piece]) -> None:
        self._pieces = pieces
        self._ahead: deque[Piece] = deque()

    def upcoming(self, pieces: int, within: int | None = None) -> list[int]:
        """The shards of its current piece and the `pieces - 1` after it; of those that
        start within its next `within` samples, where given (a run's last step is near)."""
        while len(self._ahead) < pieces:
            self._ahead.append(next(self._pieces))
        shards, start = [], 0
        for piece in list(self._ahead)[:pieces]:
            if within is not None and start >= within:
                break
            shards.append(piece.shard)
            start += len(piece.rows)
        return shards

    def take(self, samples: int) -> list[Piece]:
        """The next samples, as the pieces (shard and rows) they come from."""
        taken = []
        while samples:
            self.upcoming(1)
            piece = self._ahead[0]
            rows, rest = piece.rows[:samples], piece.rows[samples:]
            taken.append(Piece(piece.shard, rows))
            samples -= len(rows)
            if len(rest):
                self._ahead[0] = Piece(piece.shard, rest)
            else:
                self._ahead.popleft()
        return taken


class ShardCache:
    """Shards fetched and decoded on a pool of threads, each held while a lane wants it;
    the pool its own, or one it shares (a run on buckets: one pool for every bucket)."""

    def __init__(self, load: LoadShard, pool: ThreadPoolExecutor, *, owns_pool: bool) -> None:
        self._load = load
        self._pool = pool
        self._owns_pool = owns_pool
        self._held: dict[int, Future] = {}

    def want(self, shards: Iterable[int]) -> None:
        """Holds these shards (fetching those not held, in this order) and no others."""
        wanted = dict.fromkeys(shards)
        for shard in self._held.keys() - wanted.keys():
            self._held.pop(shard).cancel()
        for shard in wanted:
            if shard not in self._held:
                self._held[shard] = self._pool.submit(self._load, shard)

    def get(self, shard: int) -> Tensors:
        return self._held[shard].result()

    def close(self) -> None:
        if self._owns_pool:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for future in self._held.values():
            future.cancel()
        self._held = {}


def fetch_pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="sdq-shards")


def load_shards(
    inputs: tuple[LatentInput, ...], read: Callable[[str], bytes | memoryview]
) -> LoadShard:
    return lambda index: read_training_tensors(read(inputs[index].key))


class LatentStream:
    def __init__(
        self,
        inputs: tuple[LatentInput, ...],
        *,
        seed: int,
        batch_size: int,
        lanes: int,
        load: LoadShard,
        shards_ahead: int,
        threads: int,
        holdout: float = 0.0,
    ) -> None:
        if batch_size % lanes:
            raise ValueError(f"a batch of {batch_size} does not split over {lanes} data lanes")
        self.inputs = inputs
        self.seed = seed
        self.batch_size = batch_size
        self.lanes = lanes
        self.load = load
        self.shards_ahead = shards_ahead
        self.threads = threads
        # Each shard's rows that are not held out (None: every row is trained on).
        self.kept = (
            [kept_rows(item.key, item.samples, holdout, seed) for item in inputs]
            if holdout
            else None
        )

    def samples(self) -> int:
        """The samples it trains on."""
        return sum(map(len, self.kept)) if self.kept else sum(item.samples for item in self.inputs)

    def batches(
        self,
        first_step: int,
        lanes: range | None = None,
        allocate: Allocate = np.empty,
        last_step: int | None = None,
        pool: ThreadPoolExecutor | None = None,
    ) -> Iterator[Batch]:
        """Batch after batch from the one step `first_step` trains on up to `last_step`
        (the run's last: no shard past it is fetched), of each the samples of `lanes`
        (a rank's share; all of them by default), fetched on `pool` (one of its own by
        default)."""
        per_lane = self.batch_size // self.lanes
        mine = [
            Lane(
                lane_pieces(
                    self.inputs,
                    seed=self.seed,
                    lanes=self.lanes,
                    lane=lane,
                    offset=first_step * per_lane,
                    kept=self.kept,
                )
            )
            for lane in lanes or range(self.lanes)
        ]
        own = pool is None
        cache = ShardCache(self.load, fetch_pool(self.threads) if own else pool, owns_pool=own)
        try:
            steps = (
                count(first_step + 1) if last_step is None else range(first_step + 1, last_step + 1)
            )
            for step in steps:
                pieces = [piece for lane in mine for piece in lane.take(per_lane)]
                left = None if last_step is None else (last_step - step) * per_lane
                cache.want(self._wanted(pieces, mine, left))
                yield _gather(step, pieces, cache, allocate)
        finally:
            cache.close()

    def _wanted(self, pieces: list[Piece], lanes: list[Lane], left: int | None) -> list[int]:
        """This batch's shards first, then each lane's next ones, nearest first: those the
        `left` samples of each lane's steps still to come need, where the run's last step
        bounds them."""
        upcoming = [lane.upcoming(1 + self.shards_ahead, within=left) for lane in lanes]
        later = [
            shards[depth]
            for depth in range(1 + self.shards_ahead)
            for shards in upcoming
            if depth < len(shards)
        ]
        return [piece.shard for piece in pieces] + later


def _gather(step: int, pieces: list[Piece], cache: ShardCache, allocate: Allocate) -> Batch:
    """The pieces' rows of each of their shards' tensors, one after another."""
    first = cache.get(pieces[0].shard)
    total = sum(len(piece.rows) for piece in pieces)
    gathered = {
        name: allocate((total, *array.shape[1:]), array.dtype) for name, array in first.items()
    }
    start = 0
    for piece in pieces:
        tensors = cache.get(piece.shard)
        end = start + len(piece.rows)
        for name, out in gathered.items():
            np.take(tensors[name], piece.rows, axis=0, out=out[start:end])
        start = end
    latents, embeddings = gathered.pop("latents"), gathered.pop("text_embeddings")
    return Batch(step, latents, embeddings, added=gathered)


# Steps whose buckets are drawn at once: the draws of step k depend on its block alone.
BUCKET_BLOCK = 4096
# Keeps the bucket draws' generators apart from the permutations' ([seed, epoch, shard]).
BUCKET_DRAWS = 2**31 - 1


def bucket_schedule(sizes: Sequence[int], seed: int, first: int, last: int) -> np.ndarray:
    """The bucket (an index into `sizes`) of each step in (first, last], each drawn in
    proportion to the buckets' samples."""
    if last <= first:
        return np.empty(0, np.int64)
    share = np.asarray(sizes, dtype=np.float64) / sum(sizes)
    blocks = range(first // BUCKET_BLOCK, (last - 1) // BUCKET_BLOCK + 1)
    drawn = np.concatenate([
        np.random.default_rng([seed, BUCKET_DRAWS, block]).choice(len(sizes), BUCKET_BLOCK, p=share)
        for block in blocks
    ])  # fmt: skip
    start = blocks[0] * BUCKET_BLOCK
    return drawn[first - start : last - start]


class BucketedStream:
    """Global batches each of one aspect-ratio bucket: a LatentStream per bucket, the
    buckets taken in the seeded order of `bucket_schedule`."""

    def __init__(self, inputs: tuple[LatentInput, ...], *, load: LoadShard, **stream) -> None:
        names = sorted({item.bucket for item in inputs})
        self.seed = stream["seed"]
        self.streams = [
            LatentStream(
                tuple(inputs[index] for index in where),
                load=lambda shard, where=where: load(where[shard]),
                **stream,
            )
            for where in (
                [index for index, item in enumerate(inputs) if item.bucket == name]
                for name in names
            )
        ]
        self.names = names
        self.sizes = [stream.samples() for stream in self.streams]
        self.threads = stream["threads"]

    def batches(
        self,
        first_step: int,
        lanes: range | None = None,
        allocate: Allocate = np.empty,
        last_step: int | None = None,
    ) -> Iterator[Batch]:
        """As LatentStream.batches, each batch one bucket's; each bucket's stream starts
        at its steps before `first_step` and fetches nothing past its steps by `last_step`,
        on one pool for all (as many threads as a square run's)."""
        before = self._steps_by(first_step)
        by_last = None if last_step is None else self._steps_by(last_step)
        started: dict[int, Iterator[Batch]] = {}
        pool = fetch_pool(self.threads)
        try:
            for step, bucket in enumerate(self._schedule(first_step, last_step), first_step + 1):
                if bucket not in started:  # a bucket's stream starts when first drawn
                    last = None if by_last is None else int(by_last[bucket])
                    stream = self.streams[bucket]
                    started[bucket] = stream.batches(
                        int(before[bucket]), lanes, allocate, last, pool
                    )
                batch = next(started[bucket])
                yield replace(batch, step=step, bucket=self.names[bucket])
        finally:
            for batches in started.values():
                batches.close()
            pool.shutdown(wait=False, cancel_futures=True)

    def _steps_by(self, step: int) -> np.ndarray:
        """Each bucket's steps among the run's first `step`."""
        drawn = bucket_schedule(self.sizes, self.seed, 0, step)
        return np.bincount(drawn, minlength=len(self.sizes))

    def _schedule(self, first_step: int, last_step: int | None) -> Iterator[int]:
        """The bucket of each step after `first_step`, a block of draws at a time."""
        step = first_step
        while last_step is None or step < last_step:
            end = (step // BUCKET_BLOCK + 1) * BUCKET_BLOCK
            end = end if last_step is None else min(end, last_step)
            yield from map(int, bucket_schedule(self.sizes, self.seed, step, end))
            step = end

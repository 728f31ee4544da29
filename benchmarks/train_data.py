"""The train data path alone: sdq's latent stream over latent shards at SD 2's shapes (4x32x32
latents, 77x1024 text embeddings, fp16, 1,000-row shards), in the binary layout sdq writes
now against the fixed-size-list layout (zstd) it wrote before, from a local folder and
from an S3 server over HTTP (moto), on one core.

- samples/s: one rank reads every lane of the run for one epoch (each shard fetched once:
  no read-ahead, which a single core gains nothing from), after one epoch untimed, the
  process pinned to one core,
  from each store: sdq's stream over the binary layout; the same stream over the list
  layout; and the previous data path, as sdq read shards before (the list layout, each
  shard converted to float32, batches stacked sample by sample), written out here.
- bytes: ranks are simulated at world sizes 1, 2, 4 and 8 (each a stream over its own
  lanes, as a rank process builds it, reading ahead as a rank does), over `--bytes-shards`
  shards in a local folder (many more than the lanes hold at once, as in a real dataset:
  with few, one rank alone finds some of a lane's next shards held by another lane), and
  the bytes each fetches are counted over a run of two epochs' steps (read ahead within
  it, never past its last step, as a run's ranks read). `bytes_per_rank_over_ideal`
  is, for each world size, the most any rank fetched over 1/N of what one rank alone did.

With `--buckets`, the same figures over aspect-ratio buckets (`sdq train --buckets`): shards
of three buckets whose latents have the square's pixel count (32x32, 16x64 and 64x16), read
by the bucketed stream (a stream per bucket, each batch one bucket's), against as many
square shards of the same bytes; `buckets_over_square` is its samples/s per core over the
square's, and `bytes_per_rank_over_ideal` is the bucketed run's. Each bucket has as many
shards as the square figures use in all (`--shards`, `--bytes-shards`): a bucket of fewer
shards than its lanes hold at once is read by every lane of one rank alone from one cache,
which makes 1/N of that rank's bytes no ideal at all.

Prints one JSON object with `speedup` (sdq's samples/s per core over the previous data
path's, same data, from the local folder, where the format and not the fetch decides;
`speedup_by_store` and `layout_speedup_by_store`, the stream's own over the list layout,
beside it) and `bytes_per_rank_over_ideal`. The S3 server here is moto, one Python
process on this machine's other core serving ~60 MB/s: from it the fetch bounds both
paths, and its figures say so rather than what the format costs.

    python benchmarks/train_data.py [--shards 8] [--bytes-shards 64] [--rows 1000]
        [--batch-size 64] [--buckets]
"""

import argparse
import io
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdq.models.store import LocalStore, ObjectStore, S3Store  # noqa: E402
from sdq.models.train.specs import LatentInput  # noqa: E402
from sdq.workers.shards.latents import Encoded, latent_shard_bytes  # noqa: E402
from sdq.workers.train.loop.data import BucketedStream, LatentStream, load_shards  # noqa: E402
from tests.old_shards import list_layout_bytes  # noqa: E402
from tests.services import MotoServer, aws_env, s3_client  # noqa: E402

LATENT_SHAPE, EMBEDDING_SHAPE, TOKENS = (4, 32, 32), (77, 1024), 77
BUCKET = "train-data-bench"
LANES = 8
WORLD_SIZES = (1, 2, 4, 8)
# Epochs the bucketed and square streams are timed over (see buckets_against_squares).
EPOCHS = 2
# Buckets whose latents hold the square's pixels (LATENT_SHAPE's), as latent height x width.
BUCKET_SHAPES = ((32, 32), (16, 64), (64, 16))


def shard_tensors(rows: int, seed: int, latent_shape=LATENT_SHAPE) -> Encoded:
    rng = np.random.default_rng(seed)
    return Encoded(
        seeds=list(range(rows)),
        latents=rng.standard_normal((rows, *latent_shape), dtype=np.float32).astype(np.float16),
        text_embeddings=rng.standard_normal((rows, *EMBEDDING_SHAPE), dtype=np.float32).astype(
            np.float16
        ),
        token_ids=rng.integers(0, 49408, (rows, TOKENS)),
    )


LAYOUTS: dict[str, Callable[[dict, Encoded], bytes]] = {
    "binary": lambda lineage, tensors: latent_shard_bytes(lineage, tensors, {}),
    "list": lambda lineage, tensors: list_layout_bytes(tensors, lineage),
}


def write_shards(
    stores: list[ObjectStore],
    shards: int,
    rows: int,
    layouts=tuple(LAYOUTS),
    prefix: str = "",
    buckets: bool = False,
) -> dict[str, tuple]:
    """Each layout's shards in every store; the inputs of a run over them, by layout.
    `buckets`: shard n in bucket n mod 3 of BUCKET_SHAPES."""
    inputs: dict[str, list[LatentInput]] = defaultdict(list)
    for number in range(shards):
        height, width = BUCKET_SHAPES[number % len(BUCKET_SHAPES)] if buckets else (32, 32)
        bucket = f"{width * 8}x{height * 8}" if buckets else None
        tensors = shard_tensors(rows, number, (LATENT_SHAPE[0], height, width))
        lineage = {"key": [f"{number:05d}{row:04d}" for row in range(rows)]}
        for layout in layouts:
            write = LAYOUTS[layout]
            key = f"latents/{prefix}{layout}/{number:05d}.parquet"
            data = write(lineage, tensors)
            for store in stores:
                store.put_bytes(key, data, content_type="application/octet-stream")
            inputs[layout].append(LatentInput(uri=key, key=key, samples=rows, bucket=bucket))
    return {layout: tuple(items) for layout, items in inputs.items()}


def stream(inputs: tuple, read: Callable, args, ahead: int) -> LatentStream | BucketedStream:
    bucketed = inputs[0].bucket is not None
    return (BucketedStream if bucketed else LatentStream)(
        inputs,
        seed=0,
        batch_size=args.batch_size,
        lanes=LANES,
        load=load_shards(inputs, read),
        shards_ahead=ahead,
        threads=1,
    )


def epoch_steps(inputs: tuple, args) -> int:
    return sum(item.samples for item in inputs) // args.batch_size


def samples_per_second(inputs: tuple, store: ObjectStore, args, epochs: int = 1) -> float:
    """One rank reading every lane for `epochs` epochs, on this process's one core."""
    steps = epochs * epoch_steps(inputs, args)
    started = time.perf_counter()
    for _ in islice(stream(inputs, store.get_large, args, ahead=0).batches(0), steps):
        pass
    return steps * args.batch_size / (time.perf_counter() - started)


def previous_path_samples_per_second(inputs: tuple, store: ObjectStore, args) -> float:
    """The data path as sdq had it: shard after shard read whole, its tensors converted to
    float32, each batch stacked sample by sample (one epoch, rows shuffled per shard)."""
    started = time.perf_counter()
    samples = 0
    for number, item in enumerate(inputs):
        table = pq.read_table(
            io.BytesIO(store.get_bytes(item.key)), columns=["latents", "text_embeddings"]
        )
        latents, embeddings = (
            np.asarray(table.column(name).combine_chunks().values.to_numpy(zero_copy_only=False))
            .reshape(len(table), *shape)
            .astype(np.float32)
            for name, shape in (("latents", LATENT_SHAPE), ("text_embeddings", EMBEDDING_SHAPE))
        )
        rows = np.random.default_rng([0, number]).permutation(len(table))
        for start in range(0, len(rows) - args.batch_size + 1, args.batch_size):
            batch = rows[start : start + args.batch_size]
            np.stack([latents[row] for row in batch])
            np.stack([embeddings[row] for row in batch])
            samples += len(batch)
    return samples / (time.perf_counter() - started)


def warm(measure: Callable[..., float], *args) -> float:
    """The second of two epochs in a row: what a long run sees once the allocator holds
    the memory its batches and shards take (the first epoch also pays for the kernel
    handing that memory out)."""
    measure(*args)
    return measure(*args)


def bytes_per_rank(inputs: tuple, store: ObjectStore, args, world_size: int) -> list[int]:
    """The bytes each of `world_size` simulated ranks fetches over two epochs' steps."""
    steps = 2 * epoch_steps(inputs, args)
    fetched = []
    for rank in range(world_size):
        count = [0]

        def read(key: str, count=count):
            data = store.get_large(key)
            count[0] += len(data)
            return data

        share = LANES // world_size
        lanes = range(rank * share, (rank + 1) * share)
        # A run of `steps` steps, as a rank reads one: ahead of each step, never past its
        # last. Without that bound a rank went on fetching shards ahead of steps nobody
        # took, and the figure moved with how far its threads had got when it stopped.
        for _ in stream(inputs, read, args, ahead=1).batches(0, lanes, last_step=steps):
            pass
        fetched.append(count[0])
    return fetched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--bytes-shards", type=int, default=64)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--buckets", action="store_true", help="aspect-ratio buckets too")
    args = parser.parse_args()
    if args.buckets:
        return buckets_against_squares(args)
    server = MotoServer().start()
    try:
        os.environ.update(aws_env(server.endpoint))
        s3_client(server.endpoint).create_bucket(Bucket=BUCKET)
        with tempfile.TemporaryDirectory(prefix="sdq-train-data-") as folder:
            stores = {"local": LocalStore(Path(folder)), "s3": S3Store(BUCKET)}
            inputs = write_shards(list(stores.values()), args.shards, args.rows)
            many = write_shards([stores["local"]], args.bytes_shards, args.rows, ("binary",),
                                "many-")  # fmt: skip
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, this rank's
            speed = {}
            for where, store in stores.items():
                for layout in LAYOUTS:
                    speed[f"{layout}_{where}"] = warm(
                        samples_per_second, inputs[layout], store, args
                    )
                speed[f"previous_{where}"] = warm(
                    previous_path_samples_per_second, inputs["list"], store, args
                )
            fetched = {n: bytes_per_rank(many["binary"], stores["local"], args, n)
                       for n in WORLD_SIZES}  # fmt: skip
    finally:
        server.stop()
    alone = fetched[1][0]
    speedups = {
        where: round(speed[f"binary_{where}"] / speed[f"previous_{where}"], 2) for where in stores
    }
    layout_speedups = {
        where: round(speed[f"binary_{where}"] / speed[f"list_{where}"], 2) for where in stores
    }
    print(
        json.dumps(
            {
                "shards": args.shards,
                "bytes_shards": args.bytes_shards,
                "rows_per_shard": args.rows,
                "batch_size": args.batch_size,
                "lanes": LANES,
                "samples_per_second_one_core": {name: round(v, 1) for name, v in speed.items()},
                "speedup": speedups["local"],
                "speedup_by_store": speedups,
                "layout_speedup_by_store": layout_speedups,
                "bytes_per_rank": fetched,
                "bytes_per_rank_over_ideal": {
                    n: round(max(per_rank) / (alone / n), 3) for n, per_rank in fetched.items()
                },
            },
            indent=2,
        )
    )


def buckets_against_squares(args) -> None:
    """The bucketed stream against the square one, over shards of the same bytes."""
    shards, bytes_shards = (len(BUCKET_SHAPES) * n for n in (args.shards, args.bytes_shards))
    with tempfile.TemporaryDirectory(prefix="sdq-train-data-") as folder:
        store = LocalStore(Path(folder))
        runs = {
            "square": write_shards([store], shards, args.rows, ("binary",), "square-"),
            "buckets": write_shards([store], shards, args.rows, ("binary",), "buckets-",
                                    buckets=True),
        }  # fmt: skip
        many = write_shards([store], bytes_shards, args.rows, ("binary",), "many-",
                            buckets=True)  # fmt: skip
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, this rank's
        # Over several epochs: the buckets are drawn at random, so over one epoch's steps
        # some have started their second epoch's shards while others have not finished
        # their first; over more, that evens out, as over a run.
        speed = {
            name: warm(samples_per_second, inputs["binary"], store, args, EPOCHS)
            for name, inputs in runs.items()
        }
        fetched = {n: bytes_per_rank(many["binary"], store, args, n) for n in WORLD_SIZES}
    alone = fetched[1][0]
    print(json.dumps({
        "shards": shards,
        "bytes_shards": bytes_shards,
        "rows_per_shard": args.rows,
        "batch_size": args.batch_size,
        "lanes": LANES,
        "bucket_latent_shapes": [list(shape) for shape in BUCKET_SHAPES],
        "samples_per_second_one_core": {name: round(v, 1) for name, v in speed.items()},
        "buckets_over_square": round(speed["buckets"] / speed["square"], 3),
        "bytes_per_rank": fetched,
        "bytes_per_rank_over_ideal": {
            n: round(max(per_rank) / (alone / n), 3) for n, per_rank in fetched.items()
        },
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()

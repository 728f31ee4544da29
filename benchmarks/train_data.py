"""The train data path alone: sdq's latent stream over latent shards at SD 2's shapes (4x32x32
latents, 77x1024 text embeddings, fp16, 1,000-row shards), in the binary layout sdq writes
now against the fixed-size-list layout (zstd) it wrote before, from a local folder and
from an S3 server over HTTP (moto), on one core.

- samples/s: one rank reads every lane of the run for a whole epoch, one fetch thread,
  the process pinned to one core, each format from each store. No model: what is timed is
  what a rank's data path costs before the device sees a batch.
- bytes: ranks are simulated at world sizes 1, 2, 4 and 8 (each a stream over its own
  lanes, as a rank process builds it), and the bytes each fetches from the store are
  counted over the same steps. `bytes_per_rank_over_ideal` is, for each world size, the
  most any rank fetched over 1/N of what one rank alone fetched.

Prints one JSON object with `speedup` (the binary layout's samples/s over the list
layout's, same data, same store: the smaller of the two stores' ratios) and
`bytes_per_rank_over_ideal`.

    python benchmarks/train_data.py [--shards 8] [--rows 1000] [--batch-size 64]
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
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdq.models.store import LocalStore, ObjectStore, S3Store  # noqa: E402
from sdq.models.training import LatentInput  # noqa: E402
from sdq.workers.shards.latents import METADATA_KEY, Encoded, latent_shard_bytes  # noqa: E402
from sdq.workers.train.data import LatentStream, load_shards  # noqa: E402
from tests.services import MotoServer, aws_env, s3_client  # noqa: E402

LATENT_SHAPE, EMBEDDING_SHAPE, TOKENS = (4, 32, 32), (77, 1024), 77
BUCKET = "train-data-bench"
LANES = 8
WORLD_SIZES = (1, 2, 4, 8)


def shard_tensors(rows: int, seed: int) -> Encoded:
    rng = np.random.default_rng(seed)
    return Encoded(
        seeds=list(range(rows)),
        latents=rng.standard_normal((rows, *LATENT_SHAPE), dtype=np.float32).astype(np.float16),
        text_embeddings=rng.standard_normal((rows, *EMBEDDING_SHAPE), dtype=np.float32).astype(
            np.float16
        ),
        token_ids=rng.integers(0, 49408, (rows, TOKENS)),
    )


def list_layout(lineage: dict[str, list[str]], tensors: Encoded) -> bytes:
    """A shard as sdq wrote them before: every tensor a fixed-size list column, zstd."""
    columns = {name: pa.array(values, pa.string()) for name, values in lineage.items()}
    described = {}
    for name, array in tensors.tensors().items():
        flat = pa.array(np.ascontiguousarray(array).reshape(-1))
        columns[name] = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(array.shape[1:])))
        described[name] = {"shape": list(array.shape[1:]), "dtype": str(array.dtype)}
    table = pa.table(columns).replace_schema_metadata(
        {METADATA_KEY: json.dumps({"tensors": described})}
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    return buffer.getvalue()


LAYOUTS: dict[str, Callable[[dict, Encoded], bytes]] = {
    "binary": lambda lineage, tensors: latent_shard_bytes(lineage, tensors, {}),
    "list": list_layout,
}


def write_shards(stores: list[ObjectStore], shards: int, rows: int) -> dict[str, tuple]:
    """Each layout's shards in every store; the inputs of a run over them, by layout."""
    inputs: dict[str, list[LatentInput]] = defaultdict(list)
    for number in range(shards):
        tensors = shard_tensors(rows, number)
        lineage = {"key": [f"{number:05d}{row:04d}" for row in range(rows)]}
        for layout, write in LAYOUTS.items():
            key = f"latents/{layout}/{number:05d}.parquet"
            data = write(lineage, tensors)
            for store in stores:
                store.put_bytes(key, data, content_type="application/octet-stream")
            inputs[layout].append(LatentInput(uri=key, key=key, samples=rows))
    return {layout: tuple(items) for layout, items in inputs.items()}


def stream(inputs: tuple, read: Callable, args, threads: int = 1) -> LatentStream:
    return LatentStream(
        inputs,
        seed=0,
        batch_size=args.batch_size,
        lanes=LANES,
        load=load_shards(inputs, read),
        shards_ahead=1,
        threads=threads,
    )


def samples_per_second(inputs: tuple, store: ObjectStore, args) -> float:
    """One rank reading every lane for one epoch, on this process's one core."""
    steps = sum(item.samples for item in inputs) // args.batch_size
    started = time.perf_counter()
    for _ in islice(stream(inputs, store.get_large, args).batches(0), steps):
        pass
    return steps * args.batch_size / (time.perf_counter() - started)


def bytes_per_rank(inputs: tuple, store: ObjectStore, args, world_size: int) -> list[int]:
    """The bytes each of `world_size` simulated ranks fetches over one epoch's steps."""
    steps = sum(item.samples for item in inputs) // args.batch_size
    fetched = []
    for rank in range(world_size):
        count = [0]

        def read(key: str, count=count):
            data = store.get_large(key)
            count[0] += len(data)
            return data

        share = LANES // world_size
        lanes = range(rank * share, (rank + 1) * share)
        for _ in islice(stream(inputs, read, args).batches(0, lanes), steps):
            pass
        fetched.append(count[0])
    return fetched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    server = MotoServer().start()
    try:
        os.environ.update(aws_env(server.endpoint))
        s3_client(server.endpoint).create_bucket(Bucket=BUCKET)
        with tempfile.TemporaryDirectory(prefix="sdq-train-data-") as folder:
            stores = {"local": LocalStore(Path(folder)), "s3": S3Store(BUCKET)}
            inputs = write_shards(list(stores.values()), args.shards, args.rows)
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, this rank's
            speed = {
                f"{layout}_{where}": samples_per_second(inputs[layout], store, args)
                for where, store in stores.items()
                for layout in LAYOUTS
            }
            fetched = {n: bytes_per_rank(inputs["binary"], stores["local"], args, n)
                       for n in WORLD_SIZES}  # fmt: skip
    finally:
        server.stop()
    alone = fetched[1][0]
    speedups = {
        where: round(speed[f"binary_{where}"] / speed[f"list_{where}"], 2) for where in stores
    }
    print(
        json.dumps(
            {
                "shards": args.shards,
                "rows_per_shard": args.rows,
                "batch_size": args.batch_size,
                "lanes": LANES,
                "samples_per_second_one_core": {name: round(v, 1) for name, v in speed.items()},
                # The smaller of the two stores' ratios; each one beside it.
                "speedup": min(speedups.values()),
                "speedup_by_store": speedups,
                "bytes_per_rank": fetched,
                "bytes_per_rank_over_ideal": {
                    n: round(max(per_rank) / (alone / n), 3) for n, per_rank in fetched.items()
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

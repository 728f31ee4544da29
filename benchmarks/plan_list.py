"""Planning a LAION-size list: `sdq download` of an N-row parquet on S3, against reading it.

A parquet list of N rows (LAION's `URL` and `TEXT` columns, in row groups of 100k) is put
on an S3 server over HTTP, untimed. Then
  - sdq: `sdq download s3://... --dataset NAME --json` end to end: the list planned from
    its metadata, one job per slice written to Postgres and sent to Redis (no worker runs);
  - plain: what a script that reads the list first does: the URL and caption columns of
    every row read from the same server.
Prints one JSON object with the seconds of each and `sdq_vs_plain` (how many times faster
sdq has the whole list planned and queued than the plain way has it read).

    python benchmarks/plan_list.py [--rows 10000000] [--rows-per-shard 10000]
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.download import COMMAND_TIMEOUT  # noqa: E402
from tests.conftest import sdq_json  # noqa: E402
from tests.services import BENCH_BUCKET, deployment  # noqa: E402

KEY = "lists/laion-part-00000.parquet"
ROW_GROUP = 100_000


def put_list(rows: int) -> None:
    """LAION-like rows, written a row group at a time straight to the S3 server."""
    s3 = pyarrow.fs.S3FileSystem(endpoint_override=os.environ["AWS_ENDPOINT_URL"])
    schema = pa.schema([("URL", pa.string()), ("TEXT", pa.string()), ("similarity", pa.float32())])
    rng = np.random.default_rng(0)
    with pq.ParquetWriter(f"{BENCH_BUCKET}/{KEY}", schema, filesystem=s3) as writer:
        for first in range(0, rows, ROW_GROUP):
            numbers = range(first, min(rows, first + ROW_GROUP))
            writer.write_table(
                pa.table(
                    {
                        "URL": [f"https://images.example.com/{n:09d}/{n * 7919 % 100003}.jpg"
                                for n in numbers],
                        "TEXT": [f"a photo of thing number {n}" for n in numbers],
                        "similarity": rng.random(len(numbers), dtype=np.float32),
                    },
                    schema=schema,
                )
            )  # fmt: skip


def read_every_row() -> float:
    s3 = pyarrow.fs.S3FileSystem(endpoint_override=os.environ["AWS_ENDPOINT_URL"])
    started = time.perf_counter()
    table = pq.read_table(f"{BENCH_BUCKET}/{KEY}", columns=["URL", "TEXT"], filesystem=s3)
    seconds = time.perf_counter() - started
    assert table.num_rows > 0
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--rows-per-shard", type=int, default=10_000)
    args = parser.parse_args()
    with deployment() as env:
        os.environ.update(env)  # pyarrow's S3 client in this process reads AWS_* too
        put_list(args.rows)
        started = time.perf_counter()
        submitted = sdq_json(
            env, "download", f"s3://{BENCH_BUCKET}/{KEY}", "--dataset", "laion",
            "--url-col", "URL", "--caption-col", "TEXT",
            "--rows-per-shard", str(args.rows_per_shard), timeout=COMMAND_TIMEOUT,
        )  # fmt: skip
        sdq_seconds = time.perf_counter() - started
        plain_seconds = read_every_row()
    print(
        json.dumps(
            {
                "rows": args.rows,
                "jobs": submitted["jobs"],
                "sdq_plan_and_queue_seconds": round(sdq_seconds, 2),
                "plain_read_seconds": round(plain_seconds, 2),
                "sdq_vs_plain": round(plain_seconds / sdq_seconds, 2),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

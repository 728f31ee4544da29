"""Curation at scale: `sdq curate` against a plain batched CLIP loop on the same image
shards, with a width-reduced CLIP (random weights, built and saved as a transformers folder
by benchmarks/clips.py) and a LAION-layout aesthetic head.

The image shards are made once, untimed: N generated JPEGs of mixed sizes served over local
HTTP, through `sdq download`. Then, in interleaved rounds, the same shards go through
  - sdq: `sdq curate --wait` end to end, one `sdq worker gpu` process (Redis, Postgres,
    shards read from and embeddings written to an S3 server over HTTP, scores in SQL);
  - plain: `python benchmarks/plain_curate.py`, the loop a curation script is: each shard
    read from the same S3 server, its images decoded and preprocessed by CLIP's image
    processor, batch after batch through the same CLIP and head, embeddings and scores
    written to local parquet.
Both are timed as commands, from start to exit: sdq's worker is up and has loaded CLIP (a
service), the plain script imports and loads its own (as torchrun's processes start with
the command in train_scaling.py). The plain script imports nothing of sdq, and runs under
the same allocator setting as sdq's workers (SAME_ALLOCATOR). Each round scores afresh (the
earlier round's curate runs are deleted, so nothing is served from the cache). Prints one
JSON object with samples/s of each (medians over rounds) and `sdq_vs_plain` (the median
per-round ratio of the commands); `sdq_vs_plain_loop` sets sdq's command against the plain
loop alone, its process already started and its model loaded, and `sdq_work_vs_plain`
the jobs' own work against that loop.

    python benchmarks/curate.py [--images 1024] [--rounds 3] [--batch-size 64]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.clips import build_clip, build_head  # noqa: E402
from benchmarks.download import COMMAND_TIMEOUT, download_dataset  # noqa: E402
from tests.conftest import WorkerProcess, sdq_json  # noqa: E402
from tests.services import BENCH_BUCKET, deployment  # noqa: E402

DATASET = "curate-bench"
ROWS_PER_SHARD = 256
RESOLUTION = 128
# The allocator setting `sdq worker gpu` gives its workers (glibc keeps freed buffers of up
# to 32 MiB for reuse), given to the plain loop too: under glibc's defaults its speed is
# the allocator's luck (165,000 to 670,000 page faults a pass over 2,048 images, from one
# process to the next), and the ratio would credit sdq with a setting anyone can make.
SAME_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def forget_curation(database_url: str) -> None:
    """As if the dataset had never been scored: the next curate does all the work."""
    with psycopg.connect(database_url) as connection:
        connection.execute("DELETE FROM runs WHERE kind = 'curate'")
        connection.execute("DELETE FROM sample_scores")


def through_sdq(env: dict[str, str], clip: Path, head: Path, args) -> dict[str, float]:
    """Samples/s end to end, the jobs' own samples/s (reading, scoring, writing), and where
    the rest of the command's time went: before the first job started (the command's start,
    its checks, the submit, the queue) and after the last one ended (seeing it, the report)."""
    forget_curation(env["SDQ_DATABASE_URL"])
    started = time.time()
    sdq_json(
        env, "curate", DATASET, "--model", str(clip), "--aesthetic-head", str(head),
        "--batch-size", str(args.batch_size), "--wait", timeout=COMMAND_TIMEOUT,
    )  # fmt: skip
    ended = time.time()
    with psycopg.connect(env["SDQ_DATABASE_URL"]) as connection:
        [scored] = connection.execute("SELECT count(*) FROM sample_scores").fetchone()
        first, last, work = connection.execute(
            "SELECT extract(epoch FROM min(started_at)), extract(epoch FROM max(finished_at)), "
            "sum(work_seconds) FROM jobs WHERE kind = 'curate'"
        ).fetchone()
    return {
        "end_to_end": scored / (ended - started),
        "work": scored / float(work),
        "before_first_job": float(first) - started,
        "after_last_job": ended - float(last),
    }


def through_plain(env: dict[str, str], keys: list[str], clip: Path, head: Path, args):
    """Samples/s of the plain script run as its user runs it, a command whose wall time
    holds its imports and its model's load (as `sdq curate`'s holds the command's start),
    and of its loop alone."""
    started = time.time()
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/plain_curate.py"), "--bucket", BENCH_BUCKET,
         "--clip", str(clip), "--head", str(head), "--batch-size", str(args.batch_size), *keys],
        env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=True,
    )  # fmt: skip
    wall = time.time() - started
    figures = json.loads(done.stdout)
    return {"end_to_end": figures["samples"] / wall,
            "loop": figures["samples"] / figures["loop_seconds"]}  # fmt: skip


def main() -> None:
    if any(os.environ.get(name) != value for name, value in SAME_ALLOCATOR.items()):
        # glibc reads the setting once, at the process's start.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **SAME_ALLOCATOR})
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--image-dir", type=Path, default=Path(tempfile.gettempdir()) / "sdq-bench-images"
    )
    args = parser.parse_args()
    sdq: list[dict[str, float]] = []
    plain: list[dict[str, float]] = []
    with deployment() as env:
        os.environ.update(env)  # boto3 in this process reads AWS_* like the worker does
        home = Path(env["SDQ_HOME"])
        clip, head = build_clip(home / "bench-clip"), build_head(home / "aesthetic.safetensors")
        download_dataset(env, args.image_dir, images=args.images, name=DATASET,
                         resolution=RESOLUTION, rows_per_shard=ROWS_PER_SHARD)  # fmt: skip
        worker = WorkerProcess(env, home / "gpu.log").start()
        try:
            through_sdq(env, clip, head, args)  # warm-up: the worker loads CLIP
            keys = [f"bench/datasets/{DATASET}/images/{n:05d}.parquet"
                    for n in range(-(-args.images // ROWS_PER_SHARD))]  # fmt: skip
            for _ in range(args.rounds):
                sdq.append(through_sdq(env, clip, head, args))
                plain.append(through_plain(dict(os.environ), keys, clip, head, args))
        finally:
            worker.stop()

    def median(way: list[dict[str, float]], name: str) -> float:
        return round(statistics.median(figures[name] for figures in way), 3)

    def median_ratio(name: str, plain_name: str) -> float:
        ratios = [ours[name] / theirs[plain_name] for ours, theirs in zip(sdq, plain, strict=True)]
        return round(statistics.median(ratios), 3)

    print(json.dumps({
        "images": args.images,
        "batch_size": args.batch_size,
        "samples_per_second": {"sdq": median(sdq, "end_to_end"),
                               "plain": median(plain, "end_to_end"),
                               "plain_loop": median(plain, "loop")},
        "rounds": {"sdq": [round(figures["end_to_end"], 2) for figures in sdq],
                   "plain": [round(figures["end_to_end"], 2) for figures in plain]},
        "sdq_vs_plain": median_ratio("end_to_end", "end_to_end"),
        "sdq_vs_plain_loop": median_ratio("end_to_end", "loop"),
        # The jobs' own work against the plain loop: what is left once each command's fixed
        # costs (seconds, whatever the dataset's size) are set aside.
        "sdq_work_vs_plain": median_ratio("work", "loop"),
        "sdq_seconds_before_first_job": median(sdq, "before_first_job"),
        "sdq_seconds_after_last_job": median(sdq, "after_last_job"),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()

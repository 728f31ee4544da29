"""What the queue, the database and the store cost, measured side by side in one run.

The same prompts on the tiny model, 64x64, 20 steps:
  (a) a plain diffusers loop in this process, one image per call, PNGs to a local folder;
  (b) the same loop at sdq's batch size;
  (c) `sdq submit` to one `sdq worker gpu` process on Redis + Postgres + S3 (moto server),
      timed from the submit to the last image recorded as stored;
  (d) the same loop as (b), each image also uploaded to the S3 server with boto3: the
      plain way of getting images into a store, so (c)/(d) separates what the queue and
      the database cost from what the store itself costs on this machine.
Both sides load the pipeline before the clock starts. The sides run in turn, `--rounds`
times, with fresh prompts each round (nothing is served from sdq's cache) and a pause
before each. Images/s are medians over rounds; each ratio is the median of the per-round
ratios, since a small machine's speed drifts from one minute to the next. Prints one JSON
object; `sdq_vs_plain_batched` is (c)/(b).

    python benchmarks/overhead.py [--prompts 64] [--batch-size 8] [--steps 20] [--rounds 5]
                                  [--store s3|local]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import boto3
import torch
from click.testing import CliRunner
from sqlalchemy import func, select

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdq.models.db import make_engine, session_factory  # noqa: E402
from sdq.models.jobs.lifecycle import as_utc  # noqa: E402
from sdq.models.tables import FINISHED, Job  # noqa: E402
from sdq.producer.cli.main import main as sdq  # noqa: E402
from sdq.workers.tiny import build_pipeline  # noqa: E402
from tests.conftest import WorkerProcess  # noqa: E402
from tests.services import BENCH_BUCKET, deployment  # noqa: E402

SUBJECTS = [
    "a lighthouse", "a fox", "an old library", "a paper boat", "a mountain village",
    "a robot gardener", "a koi pond", "a desert caravan",
]  # fmt: skip
STYLES = ["ink", "oil paint", "pixel art", "watercolor", "charcoal", "bauhaus", "ukiyo-e", "neon"]


def prompts(count: int, round_: int) -> list[tuple[str, int]]:
    grid = [f"{subject}, {style}" for style in STYLES for subject in SUBJECTS]
    return [
        (f"{grid[index % len(grid)]} #{round_}.{index}", 1000 + index) for index in range(count)
    ]


class PlainLoop:
    """The plain way: one process, one pipeline, PNG files in a folder (and S3 objects)."""

    def __init__(self, *, steps: int, size: int) -> None:
        self.steps, self.size = steps, size
        self.bucket = None
        self.pipeline = build_pipeline()
        self.pipeline.set_progress_bar_config(disable=True)
        self.pipeline(prompt="warm-up", num_inference_steps=2, width=size, height=size)

    def seconds(self, work: list[tuple[str, int]], *, batch_size: int, s3: bool = False) -> float:
        with tempfile.TemporaryDirectory() as folder:
            started = time.perf_counter()
            for start in range(0, len(work), batch_size):
                chunk = work[start : start + batch_size]
                images = self.pipeline(
                    prompt=[prompt for prompt, _ in chunk],
                    num_inference_steps=self.steps,
                    width=self.size,
                    height=self.size,
                    generator=[torch.Generator("cpu").manual_seed(seed) for _, seed in chunk],
                ).images
                for (prompt, seed), image in zip(chunk, images, strict=True):
                    path = Path(folder) / f"{seed}.png"
                    image.save(path)
                    if s3:
                        self.bucket.upload_file(str(path), f"plain/{prompt}.png")
            return time.perf_counter() - started


class ThroughSdq:
    """`sdq submit` in this process, one `sdq worker gpu` process rendering."""

    def __init__(self, env: dict[str, str], *, steps: int, size: int, batch_size: int) -> None:
        self.env = env
        self.home = Path(env["SDQ_HOME"])
        self.options = ["--steps", str(steps), "--size", f"{size}x{size}"]
        self.options += ["--batch-size", str(batch_size)]
        self.engine = make_engine(env["SDQ_DATABASE_URL"])
        self.sessions = session_factory(self.engine)
        self.worker = WorkerProcess(env, self.home / "worker.log").start()
        self.seconds([("warm-up", 1)])  # the worker loads its pipeline here

    def seconds(self, work: list[tuple[str, int]]) -> float:
        csv = self.home / f"{uuid.uuid4().hex}.csv"
        csv.write_text("prompt,seed\n" + "".join(f'"{prompt}",{seed}\n' for prompt, seed in work))
        started = datetime.now(UTC)
        arguments = ["submit", str(csv), "--json", *self.options]
        result = CliRunner().invoke(sdq, arguments, env=self.env)
        if result.exit_code != 0:
            raise RuntimeError(result.output)
        last_stored = self._wait(json.loads(result.stdout)["run_id"], len(work))
        return (last_stored - started).total_seconds()

    def _wait(self, run_id: int, total: int) -> datetime:
        """When the run's last image was recorded, as the worker wrote it (same clock)."""
        of_run = Job.run_id == run_id
        finished = select(func.count()).where(of_run, Job.status.in_(FINISHED))
        while True:
            with self.sessions() as session:
                if session.scalar(finished) >= total:
                    return as_utc(session.scalar(select(func.max(Job.finished_at)).where(of_run)))
            # Slow polling: the end time comes from the database, and every poll takes CPU
            # the worker would otherwise have.
            time.sleep(0.2)

    def close(self) -> None:
        self.worker.stop()
        self.engine.dispose()


def paired_ratio(plain: list[float], sdq: list[float]) -> float:
    """sdq's images/s over the plain side's, per round, then the median: each round's pair
    ran back to back, so the machine's drift between rounds cancels out."""
    return round(statistics.median(p / s for p, s in zip(plain, sdq, strict=True)), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--store",
        choices=["s3", "local"],
        default="s3",
        help="where sdq stores images; `local` (a folder, like the plain loop) isolates "
        "what the queue and the database cost",
    )
    args = parser.parse_args()
    plain = PlainLoop(steps=args.steps, size=args.size)
    timings: dict[str, list[float]] = defaultdict(list)
    with deployment() as env:
        os.environ.update(env)  # boto3 in this process reads AWS_* like the worker does
        plain.bucket = boto3.resource("s3").Bucket(BENCH_BUCKET)
        if args.store == "local":
            env = {**env, "SDQ_STORE_URL": str(Path(env["SDQ_HOME"]) / "store")}
        queued = ThroughSdq(env, steps=args.steps, size=args.size, batch_size=args.batch_size)
        try:
            sides = {
                "plain_batch1": lambda work: plain.seconds(work, batch_size=1),
                "plain_batched": lambda work: plain.seconds(work, batch_size=args.batch_size),
                "plain_batched_s3": lambda work: plain.seconds(
                    work, batch_size=args.batch_size, s3=True
                ),
                "sdq": queued.seconds,
            }
            for round_ in range(args.rounds):
                work = prompts(args.prompts, round_)
                for name, measure in sides.items():
                    # Let the previous side's threads go idle before the clock starts.
                    time.sleep(1)
                    timings[name].append(measure(work))
        finally:
            queued.close()
    rate = {name: args.prompts / statistics.median(values) for name, values in timings.items()}
    print(
        json.dumps(
            {
                "images": args.prompts,
                "steps": args.steps,
                "size": f"{args.size}x{args.size}",
                "batch_size": args.batch_size,
                "rounds": args.rounds,
                "sdq_store": args.store,
                "images_per_second": {name: round(value, 2) for name, value in rate.items()},
                "seconds_per_round": {
                    name: [round(value, 2) for value in values] for name, values in timings.items()
                },
                **{
                    f"sdq_vs_{name}": paired_ratio(timings[name], timings["sdq"])
                    for name in ("plain_batch1", "plain_batched", "plain_batched_s3")
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

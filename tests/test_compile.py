"""Compiling on the CPU (inductor's C++ backend), what it made shared through the store.
`sdq train --compile`: the U-Net compiled by region, once for all of a run's jobs in a
process, its artifacts saved to the store; a process with an empty local cache (another
machine's) loads them and compiles no kernel itself. A compiled generate worker: its warm
shapes compiled once, and another worker warms from what the first left in the store."""

import ast
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, sdq_json
from tests.netns_download import DOWNLOAD_ENV
from tests.services import clean_env
from tests.test_buckets import download_found
from tests.test_train import TRAIN, encoded_dataset

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MARK = "compiled regions "


def _compiled(
    env: dict[str, str], cwd: Path, cache: Path, *, run: tuple[str, ...] = ("toy", *TRAIN)
) -> tuple[list[dict], str]:
    """A compiled `run` (by default, of two jobs) in a process of its own whose inductor
    cache is `cache`: what it logged of each compile, and its output."""
    done = subprocess.run(
        [sys.executable, "-m", "sdq.producer.cli", "--verbose", "train", *run,
         "--steps", "4", "--checkpoint-every", "2", "--compile", "--json"],
        env={**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)}, cwd=cwd, capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    logged = [ast.literal_eval(line.split(MARK, 1)[1])
              for line in done.stderr.splitlines() if MARK in line]  # fmt: skip
    return logged, done.stdout


def test_a_compiled_run_compiles_once_and_another_machine_loads_what_it_made(
    tmp_path: Path,
) -> None:
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    encoded_dataset(env, "toy", 8, tmp_path)
    [cold], first = _compiled(env, tmp_path, tmp_path / "machine-1")
    # Both jobs on the state compiled once: no second compile, no new graph.
    assert not cold["loaded"] and cold["kernels_compiled"] > 0 and cold["graphs"] >= 1
    stored = tmp_path / "sdq-data/store" / cold["key"]
    assert stored.is_file() and stored.stat().st_size > 0
    # The compile is the run's start, not its training: its seconds are in the start share.
    status = json.loads(first)
    wall = 4 * 4 / status["wall_samples_per_second"]  # 4 steps of 4 samples
    assert status["time_shares"]["start"] * wall >= 0.9 * cold["seconds"]
    assert status["time_shares"]["training"] * wall < 0.5 * cold["seconds"]
    [warm], second = _compiled(env, tmp_path, tmp_path / "machine-2")
    assert warm["key"] == cold["key"] and warm["loaded"]
    assert warm["kernels_compiled"] == 0 and warm["kernels_found"] == cold["kernels_compiled"]
    assert warm["graphs"] == cold["graphs"]
    # The same kernels: the same losses, step for step.
    assert json.loads(first)["losses"] == json.loads(second)["losses"]


def test_a_compiled_run_on_buckets_shares_each_bucket_s_kernels(tmp_path: Path) -> None:
    """Steps of several shapes (one bucket's batch each): each shape's first step compiles
    and saves under the run's one key, and another machine that meets the buckets in
    another order (another seed) loads them and compiles no kernel for any bucket."""
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    download_found(env, tmp_path, [("shapes", "keep_ratio", "128")])
    sdq_json(env, "encode", "shapes", "--model", "tiny", "--buckets", "128", "--wait",
             cwd=tmp_path)  # fmt: skip
    run = ("shapes", "--base", "tiny", "--resolution", "128", "--buckets", "--batch-size", "1")
    cold, first = _compiled(env, tmp_path, tmp_path / "machine-1", run=run)
    warm, second = _compiled(env, tmp_path, tmp_path / "machine-2", run=(*run, "--seed", "7"))
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        orders = [
            list(dict.fromkeys(bucket for (bucket,) in db.execute(
                "SELECT bucket FROM train_steps WHERE run_id = ? ORDER BY step",
                (json.loads(made)["run_id"],),
            )))
            for made in (first, second)
        ]  # fmt: skip
    # Each met its buckets in its own order, the first not the same.
    assert len(orders[0]) >= 2 and orders[0][0] != orders[1][0], orders
    # One key, loaded at the first step; a shape's first step each (logged). Its graphs
    # have dynamic sizes: made at the first step, they serve every later bucket's.
    assert [len(cold), len(warm)] == [len(order) for order in orders]
    assert len({shape["key"] for shape in cold + warm}) == 1
    assert [shape["loaded"] for shape in cold] == [False] * len(cold)
    assert cold[0]["kernels_compiled"] > 0 and cold[0]["kernels_found"] == 0
    counted = ("graphs", "kernels_compiled")
    assert {tuple(shape[key] for key in counted) for shape in cold} == {
        tuple(cold[0][key] for key in counted)
    }
    assert warm[0]["loaded"] and warm[-1]["kernels_compiled"] == 0
    assert warm[-1]["kernels_found"] == cold[-1]["kernels_compiled"]


WARM_FROM_STORE = """
import json, sys
from pathlib import Path
import numpy as np
from sdq.models.registry import tiny_identity
from sdq.models.store import LocalStore
from sdq.producer.generate.plan import Defaults, plan_jobs
from sdq.producer.prompts import PromptRow
from sdq.workers.compiled import compile_counts
from sdq.workers.generate.pipelines import PipelineCache, render
from sdq.workers.weights import ModelFiles

folder = Path(sys.argv[1])
files = ModelFiles(LocalStore(folder / "store"), folder / sys.argv[2] / "models")
pipelines = PipelineCache(files=files, size=1, compile_mode="default", compile_batches=(1,),
                          warm_shapes=((64, 64),))
[job] = plan_jobs([PromptRow(line=2, prompt="a lighthouse")], model=tiny_identity(),
                  defaults=Defaults(seed=3, steps=2, dtype="float32"))
loaded, _ = pipelines.get(job.spec)
warmed = compile_counts()
[image] = render(loaded, [job.spec])
print(json.dumps({**warmed, "after_call": compile_counts(), "pixels": np.asarray(image).tolist()}))
"""


def _generate_worker(folder: Path, machine: str) -> dict:
    """A compiled generate worker's process, with an inductor cache of its own (`machine`)
    and the store shared: what it compiled warming, and its first image."""
    done = subprocess.run(
        [sys.executable, "-c", WARM_FROM_STORE, str(folder), machine],
        env={**clean_env(), "PYTHONPATH": str(ROOT),
             "TORCHINDUCTOR_CACHE_DIR": str(folder / machine / "inductor")},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_compiled_generate_worker_warms_from_what_another_one_compiled(tmp_path: Path) -> None:
    """The first worker compiles its warm shapes and leaves the artifacts in the store; a
    second, on another machine (its own empty inductor cache), loads them and compiles no
    kernel: it finds every one the first compiled, and renders the same pixels."""
    cold = _generate_worker(tmp_path, "machine-1")
    assert cold["kernels_compiled"] > 0 and cold["kernels_found"] == 0
    [stored] = (tmp_path / "store" / "compiled" / "generate").iterdir()
    assert stored.stat().st_size > 0
    warm = _generate_worker(tmp_path, "machine-2")
    assert warm["kernels_compiled"] == 0 and warm["kernels_found"] == cold["kernels_compiled"]
    assert warm["graphs"] == cold["graphs"]
    # Warm shapes are all a call meets: nothing compiled at the first job.
    counted = ("graphs", "kernels_found", "kernels_compiled")
    assert cold["after_call"] == {key: cold[key] for key in counted}
    assert warm["pixels"] == cold["pixels"]

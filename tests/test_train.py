"""sdq train end to end: the whole chain embedded (download -> encode -> train ->
generate, and SQL from the image back to its URLs), and on the services with a real
worker process: a SIGKILL mid-job resumes to bit-for-bit the weights of an uninterrupted
run, and a train-shard job delivered again finds its step done."""

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
import psycopg
import pytest
import torch
from selenium.webdriver.common.by import By
from sqlalchemy import select

from sdq.models.db import make_engine, session_factory
from sdq.models.jobs.kinds import TRAIN as TRAIN_KIND
from sdq.models.jobs.lifecycle import OUTAGE
from sdq.models.jobs.outbox import open_run
from sdq.models.registry import ModelNotFound
from sdq.models.tables import Job, JobEvent, JobStatus, Run
from sdq.models.train.inputs import read_inputs_manifest
from sdq.models.train.models import checkpoint_named
from sdq.models.train.status import time_shares
from sdq.models.train.tables import Checkpoint, TrainStep
from sdq.producer.train.lookups import latest_step
from sdq.producer.train.screens import loss_curve
from sdq.workers.tiny import build_pipeline
from tests.browser import chromium, open_page, texts
from tests.conftest import BUCKET, ROOT, BeatProcess, WorkerProcess, run_sdq, sdq_json
from tests.hostile_server import HostileServer
from tests.netns_download import DOWNLOAD_ENV
from tests.services import OutageProxy, clean_env, said_after, wait_for

pytestmark = pytest.mark.timeout(600)
# The services' database is shared by the whole session: a dataset name of this file's own.
DATASET = "train-birds"
TRAIN = ["--base", "tiny", "--resolution", "64", "--batch-size", "4"]


def write_list(path: Path, base: str, rows: int) -> Path:
    lines = ["url,caption"] + [f"{base}/img/{n}.jpg,picture number {n}" for n in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def encoded_dataset(env: dict[str, str], name: str, rows: int, cwd: Path) -> None:
    with HostileServer() as server:
        listing = write_list(cwd / f"{name}.csv", server.base, rows)
        sdq_json(
            env, "download", str(listing), "--dataset", name, "--resolution", "64",
            "--rows-per-shard", "8", "--wait", cwd=cwd,
        )  # fmt: skip
    sdq_json(env, "encode", name, "--model", "tiny", "--resolution", "64", "--wait", cwd=cwd)


def test_the_whole_chain_on_one_machine(tmp_path: Path) -> None:
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    with HostileServer() as server:
        listing = write_list(tmp_path / "toy.csv", server.base, 20)
        sdq_json(
            env, "download", str(listing), "--dataset", "toy", "--resolution", "64",
            "--rows-per-shard", "8", cwd=tmp_path,
        )  # fmt: skip
    # The dataset's page: its counts, and its samples embedded, shown by a browser as they are.
    shown = sdq_json(env, "dataset", "show", "toy", cwd=tmp_path)
    assert shown["page"].startswith("file://") and shown["by_status"] == {"success": 20}
    with chromium() as browser:
        page = Path(shown["page"].removeprefix("file://"))
        assert open_page(browser, page, tmp_path / "dataset.png") == [True] * 20
        assert texts(browser, "table.status td") == ["success", "20"]
        captions = texts(browser, "figcaption")
    assert len(captions) == 20 and all(": " in caption for caption in captions)
    missing = run_sdq(env, "train", "toy", *TRAIN, "--steps", "4", cwd=tmp_path)
    assert missing.returncode == 2
    assert "dataset 'toy' has no latents made with tiny" in missing.stderr
    assert "`sdq encode toy --model tiny --resolution 64` makes them" in missing.stderr

    sdq_json(env, "encode", "toy", "--model", "tiny", "--resolution", "64", cwd=tmp_path)
    validation = tmp_path / "validation.csv"
    validation.write_text("prompt,seed\na red square,7\na blue circle,\n")
    trained = sdq_json(
        env, "train", "toy", *TRAIN, "--steps", "60", "--checkpoint-every", "30",
        "--lr", "1e-3", "--into", "toy-model", "--validation-prompts", str(validation),
        cwd=tmp_path,
    )  # fmt: skip
    assert (trained["status"], trained["step"], trained["steps"]) == ("succeeded", 60, 60)
    losses = [loss for _, loss in trained["losses"]]
    assert [step for step, _ in trained["losses"]] == list(range(1, 61))
    assert sum(losses[-10:]) < 0.8 * sum(losses[:10])  # it learns
    assert [c["step"] for c in trained["checkpoints"]] == [30, 60]
    # Its wall time, split: its start (up to its first step: the model built), training,
    # data waits, checkpoint writes, and between jobs.
    shares = trained["time_shares"]
    assert set(shares) == {
        "start", "training", "data_wait", "checkpoint", "final_checkpoint", "job_gap"
    }  # fmt: skip
    assert all(0 <= share <= 1 for share in shares.values())
    assert shares["checkpoint"] > 0 and shares["start"] > 0
    # SQLite stamps times to the second, a few percent of this short run's wall time: the
    # wall time can come out shorter than the steps took.
    assert sum(shares.values()) == pytest.approx(1, abs=0.15)
    assert 0 < trained["wall_samples_per_second"] < 1.15 * trained["samples_per_second"]
    # The run's page: the loss curve, and each checkpoint's validation images.
    store = tmp_path / "sdq-data/store"
    page = (store / f"runs/{trained['run_id']}/training.html").read_text()
    assert "<polyline" in page
    images = re.findall(r'<img src="\.\./\.\./(images/\w+\.png)"', page)
    assert len(images) == len(set(images)) == 4  # 2 checkpoints x 2 prompts, all distinct
    assert all((store / image).is_file() for image in images)
    assert "a blue circle (seed 3)" in page  # no seed given: its line
    with chromium() as browser:
        training = store / f"runs/{trained['run_id']}/training.html"
        assert open_page(browser, training, tmp_path / "training.png") == [True] * 4
        assert [row.split()[0] for row in texts(browser, "tbody th")] == ["30", "60"]
        assert browser.find_element(By.TAG_NAME, "polyline").is_displayed()

    prompts = tmp_path / "prompts.csv"
    prompts.write_text("prompt,seed\na picture,1\n")
    render = ["--steps", "2", "--dtype", "float32", "--size", "64x64"]
    by_step = sdq_json(env, "run", str(prompts), "--model", "toy-model@30", *render, cwd=tmp_path)
    newest = sdq_json(env, "run", str(prompts), "--model", "toy-model", *render, cwd=tmp_path)
    assert by_step["counts"] == newest["counts"] == {"succeeded": 1}
    image_job = newest["jobs"][0]["id"]
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        revision = db.execute(
            "SELECT json_extract(spec, '$.model_revision') FROM jobs WHERE id = ?", (image_job,)
        ).fetchone()[0]
        assert revision == trained["checkpoints"][-1]["model_revision"]
        # From the generated image back to the URLs and captions its model learned from.
        sources = db.execute(
            "SELECT train_run_id, step, url, caption FROM image_sources WHERE job_id = ?",
            (image_job,),
        ).fetchall()
        kept = db.execute("SELECT url, caption FROM samples WHERE status = 'success'").fetchall()
    assert {(step, url, caption) for _, step, url, caption in sources} == {
        (60, url, caption) for url, caption in kept
    }
    assert len(kept) == 20
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        specs = [
            json.loads(spec)
            for (spec,) in db.execute(
                "SELECT spec FROM jobs WHERE run_id = ?", (trained["run_id"],)
            )
        ]
    # The run's shards are listed once, in its manifest, never in its jobs' specs.
    assert [(spec["inputs"], spec["inputs_key"]) for spec in specs] == [
        ([], f"train/{trained['run_id']}/inputs.parquet")
    ] * 2
    manifest = read_inputs_manifest((store / specs[0]["inputs_key"]).read_bytes())
    assert sorted(item.key for item in manifest) == sorted(
        path.relative_to(store).as_posix()
        for path in store.glob("datasets/toy/latents-*/*.parquet")
    )


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_a_job_too_long_for_its_time_limit_checkpoints_early_and_the_run_ends_the_same(
    tmp_path: Path, world_size: str
) -> None:
    """Embedded, a train queue whose soft time limit is 2 s: each job takes steps for 80%
    of it, checkpoints where its ranks agree to stop, and leaves the rest to a job more;
    the run ends on the same weights, bit for bit, as one job of all its steps. On one
    rank, the same with jobs of --checkpoint-minutes, which is refused when it cannot fit
    the limit."""
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT), "SDQ_TRAIN_LOSS_EVERY": "5"}
    encoded_dataset(env, "toy", 16, tmp_path)
    # Steps enough to outlast 80% of the limit on a fast CPU too (the tiny U-Net's take a
    # few milliseconds each: 120 of them once fitted in one job).
    run = ["train", "toy", *TRAIN, "--steps", "480", "--checkpoint-every", "480",
           "--world-size", world_size]  # fmt: skip
    whole = sdq_json(env, *run, cwd=tmp_path)
    assert [c["step"] for c in whole["checkpoints"]] == [480]
    limited = sdq_json({**env, "SDQ_TRAIN_TASK_SOFT_TIME_LIMIT": "2"}, *run, cwd=tmp_path)
    ended_the_same(tmp_path, whole, limited)
    if world_size == "1":
        timed = sdq_json(env, *run, "--checkpoint-minutes", "0.025", cwd=tmp_path)
        ended_the_same(tmp_path, whole, timed)
        refused = run_sdq({**env, "SDQ_TRAIN_TASK_SOFT_TIME_LIMIT": "60"}, *run,
                          "--checkpoint-minutes", "1", cwd=tmp_path)  # fmt: skip
        said = " ".join(refused.stderr.split())
        assert refused.returncode == 2
        assert "--checkpoint-minutes 1 does not fit the train queue's time limit of 1 " in said
        assert "give at most 0.8" in said


def ended_the_same(tmp_path: Path, whole: dict, limited: dict) -> None:
    """A run of jobs cut short ended on the weights and losses of one job of all its steps,
    each of its jobs done once."""
    steps = [c["step"] for c in limited["checkpoints"]]
    last = whole["checkpoints"][-1]["step"]
    assert len(steps) > 1 and steps[-1] == last and all(step % 5 == 0 for step in steps)
    assert limited["checkpoints"][-1]["state_sha256"] == whole["checkpoints"][-1]["state_sha256"]
    assert limited["losses"] == whole["losses"]
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        jobs = db.execute(
            "SELECT status, attempts FROM jobs WHERE run_id = ?", (limited["run_id"],)
        ).fetchall()
        [job_count] = db.execute(
            "SELECT job_count FROM runs WHERE id = ?", (limited["run_id"],)
        ).fetchone()
    assert jobs == [("succeeded", 1)] * len(steps) and job_count == len(steps)


def test_steps_reach_the_database_as_they_are_taken(tmp_path: Path) -> None:
    """Embedded, one job of 400 steps on two ranks: its steps (loss, speed), which rank 0
    writes, are in SQL, and `sdq train status` shows them, long before its checkpoint is.
    A SIGTERM (a service manager's stop) then stops the command as Ctrl-C does: its job
    goes back, and no rank process outlives it. (One rank, which trains in the worker's own
    process: the Ctrl-C test below.)"""
    world_size = "2"
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT), "SDQ_TRAIN_LOSS_EVERY": "5"}
    encoded_dataset(env, "toy", 8, tmp_path)
    training = subprocess.Popen(
        [sys.executable, "-m", "sdq.producer.cli", "train", "toy", *TRAIN, "--steps", "400",
         "--checkpoint-every", "400", "--world-size", world_size],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    database = tmp_path / "sdq-data/sdq.db"

    def stepped() -> bool:
        if not database.exists():
            return False
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
            return db.execute("SELECT count(*) FROM train_steps").fetchone()[0] >= 10

    try:
        wait_for(stepped, what="steps in the database", timeout=240)
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
            [run_id] = db.execute("SELECT id FROM runs WHERE kind = 'train'").fetchone()
        status = sdq_json(env, "train", "status", str(run_id), cwd=tmp_path)
        # Named now: a process its parent left behind would no longer be the command's.
        started = psutil.Process(training.pid).children(recursive=True)
        ranks = [process for process in started if re.fullmatch(r"sdq-rank\d", process.name())]
    finally:
        training.send_signal(signal.SIGTERM)
        stderr = said_after(training, timeout=120)
    assert status["checkpoints"] == [] and status["checkpoint_step"] == 0
    assert 10 <= status["step"] < 400 and status["samples_per_second"]
    assert [step for step, _ in status["losses"]] == list(range(1, status["step"] + 1))

    assert training.returncode == 143, stderr
    assert "1 job in hand put back" in " ".join(stderr.split())
    assert len(ranks) == 2
    _, outliving = psutil.wait_procs(started, timeout=30)
    assert outliving == []
    stopped = sdq_json(env, "train", "status", str(run_id), cwd=tmp_path)
    assert stopped["status"] == "queued"


def test_a_diverged_run_ends_dead_at_once_naming_the_step_it_went_at(tmp_path: Path) -> None:
    """Embedded (SQLite, which refused a NaN loss: the job failed on its own records), on two
    ranks: a learning rate that blows the weights up ends the job it diverges in dead on its
    first attempt, not retried from a checkpoint that would diverge the same way, saying from
    which step the loss is not finite; those steps are NULL in SQL (written at once, not
    after the live steps' usual 5 s), and `sdq train status` shows them as such."""
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT), "SDQ_TRAIN_LOSS_EVERY": "2"}
    encoded_dataset(env, "toy", 8, tmp_path)
    diverging = run_sdq(env, "train", "toy", *TRAIN, "--steps", "40", "--checkpoint-every", "2",
                        "--world-size", "2", "--lr", "1e30", cwd=tmp_path)  # fmt: skip
    said = " ".join(diverging.stderr.split())
    went = re.search(
        r"Diverged: rank \d: the loss is (?:nan|inf|-inf) at step (\d+) and not finite since: "
        r"the run diverged",
        said,
    )
    assert diverging.returncode != 0 and went, said[-3000:]
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        [run_id] = db.execute("SELECT id FROM runs WHERE kind = 'train'").fetchone()
        jobs = db.execute(
            "SELECT status, attempts FROM jobs WHERE run_id = ? ORDER BY id", (run_id,)
        ).fetchall()
        losses = db.execute("SELECT step, loss FROM train_steps WHERE run_id = ? ORDER BY step",
                            (run_id,)).fetchall()  # fmt: skip
    # The steps ahead of the second job (taken while the first one's checkpoint was written)
    # diverged: that job ends dead, the first one's checkpoint is written and it succeeds.
    assert jobs == [("succeeded", 1), ("dead", 1)]
    first_not_finite = int(went[1])
    assert first_not_finite >= 2  # the first step's loss is before any update
    assert all(loss is not None for step, loss in losses if step < first_not_finite)
    assert [loss for step, loss in losses if step >= first_not_finite][:3] == [None] * 3
    status = sdq_json(env, "train", "status", str(run_id), cwd=tmp_path)
    assert [loss for _, loss in status["losses"]] == [loss for _, loss in losses]
    shown = run_sdq(env, "train", "status", str(run_id), cwd=tmp_path)
    # The curve's end, every loss of it NaN: "!" where no loss is finite.
    assert re.search(r"loss [\d.]+ \S*! not finite", " ".join(shown.stdout.split())), shown
    # However long the run, the few steps a diverged job ends with show.
    assert loss_curve([1.0] * 10_000 + [None] * 3).endswith("▁! not finite")
    # Going on from a run that is not a train run (run 1 downloaded the dataset) is refused.
    elsewhere = run_sdq(env, "train", "toy", "--resume-from", "1@best:kid", "--resolution", "64",
                        "--steps", "2", cwd=tmp_path)  # fmt: skip
    assert elsewhere.returncode == 2 and "run 1 is not a train run" in elsewhere.stderr
    nowhere = run_sdq(env, "train", "toy", "--resume-from", "999", "--resolution", "64",
                      "--steps", "2", cwd=tmp_path)  # fmt: skip
    assert nowhere.returncode == 2 and "--resume-from 999: there is no run 999" in nowhere.stderr


def test_a_name_trained_into_again_points_to_the_runs_that_have_the_step(
    migrated_postgres: str,
) -> None:
    """NAME@STEP is the newest run into NAME's: where that one has no checkpoint yet, the
    refusal says so and names the earlier runs into NAME that have the step (a generic
    "unknown model" said neither)."""
    name = f"again-{uuid.uuid4().hex[:8]}"
    sessions = session_factory(make_engine(migrated_postgres))
    with sessions.begin() as session:
        older = open_run(session, TRAIN_KIND, source="toy", options={"into": name})
        session.add(Checkpoint(run_id=older.id, step=4, uri="u", model_prefix="p",
                               model_revision="r" * 64))  # fmt: skip
        newer = open_run(session, TRAIN_KIND, source="toy", options={"into": name})
    with sessions() as session, pytest.raises(ModelNotFound) as refused:
        checkpoint_named(session, f"{name}@4")
    assert str(refused.value) == (
        f"{name}@4: {name} names run {newer.id}, the newest into it, which has no checkpoint "
        f"yet; earlier runs into {name} have it: {older.id}@4"
    )


def test_a_run_s_wall_time_splits_into_its_shares(migrated_postgres: str) -> None:
    """A run's timeline written as its jobs would (Postgres keeps the microseconds): 1 s of
    start, four 0.5 s steps with 0.1 s of data wait, a checkpoint after step 2 that held the
    steps for 0.25 s, 0.25 s between the jobs, and the final checkpoint 2 s after the last
    step. Until the run has all its steps, its newest checkpoint's write is a checkpoint
    wait; as the run's last, it is its own share."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def at(seconds: float) -> datetime:
        return t0 + timedelta(seconds=seconds)

    sessions = session_factory(make_engine(migrated_postgres))
    with sessions.begin() as session:
        run = Run(kind=TRAIN_KIND.name, source="test", options={}, job_count=2)
        session.add(run)
        session.flush()
        job = Job(run_id=run.id, kind=TRAIN_KIND.name, spec={}, spec_hash=f"shares-{run.id}")
        session.add(job)
        session.flush()
        session.add(JobEvent(job_id=job.id, status=JobStatus.running, at=t0))
        ends = {1: 1.5, 2: 2.0, 3: 3.0, 4: 3.5}  # batch 8 at 16 samples/s: 0.5 s a step
        session.add_all(
            TrainStep(run_id=run.id, step=step, loss=0.1, lr=1e-4, samples_per_second=16.0,
                      data_wait_seconds=0.1 if step == 3 else 0.0, at=at(end))
            for step, end in ends.items()
        )  # fmt: skip
        session.add_all(
            Checkpoint(run_id=run.id, step=step, uri=f"s3://b/{step}", write_seconds=waited,
                       created_at=at(recorded))
            for step, waited, recorded in [(2, 0.25, 2.2), (4, 0.1, 5.5)]
        )  # fmt: skip
    with sessions() as session:
        checkpoints = session.scalars(
            select(Checkpoint).where(Checkpoint.run_id == run.id).order_by(Checkpoint.step)
        ).all()
        done = time_shares(session, run.id, 8, checkpoints, steps=4)
        going = time_shares(session, run.id, 8, checkpoints, steps=8)
    assert done["wall_samples_per_second"] == round(4 * 8 / 5.5, 2)
    expected = {"start": 1.0, "training": 1.9, "data_wait": 0.1, "checkpoint": 0.25,
                "final_checkpoint": 2.0, "job_gap": 0.25}  # fmt: skip
    assert done["time_shares"] == {name: round(s / 5.5, 4) for name, s in expected.items()}
    expected.update(checkpoint=2.25, final_checkpoint=0.0)
    assert going["time_shares"] == {name: round(s / 5.5, 4) for name, s in expected.items()}


def _jobs(database_url: str, run_id: int) -> list[tuple]:
    with psycopg.connect(database_url) as connection:
        return connection.execute(
            "SELECT id, status, attempts, spec->>'first_step' FROM jobs WHERE run_id = %s "
            "ORDER BY id",
            (run_id,),
        ).fetchall()


def events_saying(database_url: str, run_id: int, detail: str) -> int:
    """How many of the run's job events have a detail LIKE this."""
    with psycopg.connect(database_url) as connection:
        return connection.execute(
            "SELECT count(*) FROM job_events e JOIN jobs j ON j.id = e.job_id "
            "WHERE j.run_id = %s AND e.detail LIKE %s",
            (run_id, detail),
        ).fetchone()[0]


def _train(env: dict[str, str], *args: str) -> dict:
    return sdq_json(env, "train", DATASET, *TRAIN, "--steps", "120", "--checkpoint-every", "40",
                    *args)  # fmt: skip


@pytest.mark.slow
def test_a_killed_train_worker_resumes_to_the_same_weights(
    download_env: dict[str, str],
    cpu_worker: WorkerProcess,
    worker: WorkerProcess,
    s3_client,
    tmp_path: Path,
) -> None:
    database_url = download_env["SDQ_DATABASE_URL"]
    encoded_dataset(download_env, DATASET, 16, tmp_path)
    validation = tmp_path / "validation.csv"
    validation.write_text("prompt,seed\na bird,5\n")
    steady = _train(download_env, "--wait", "--validation-prompts", str(validation))
    assert steady["status"] == "succeeded"

    run_id = _train(download_env)["run_id"]

    def second_job_running() -> int | None:
        jobs = _jobs(database_url, run_id)
        return jobs[1][0] if len(jobs) > 1 and jobs[1][1] == "running" else None

    wait_for(second_job_running, what="the second train-shard job", timeout=300)
    time.sleep(0.5)  # into its steps
    with psycopg.connect(database_url) as connection:
        holder = connection.execute(
            "SELECT worker_host FROM jobs WHERE id = %s", (second_job_running(),)
        ).fetchone()[0]
    os.kill(int(holder.rsplit(":", 1)[1]), signal.SIGKILL)

    def finished() -> bool:
        jobs = _jobs(database_url, run_id)
        return len(jobs) == 3 and all(status == "succeeded" for _, status, *_ in jobs)

    wait_for(finished, what=f"train run {run_id} to finish", timeout=300)
    jobs = _jobs(database_url, run_id)
    assert [attempts for _, _, attempts, _ in jobs] == [1, 2, 1]  # killed mid-job, redone
    # Its page was drawn by the workers as each checkpoint landed: no command has asked.
    page = s3_client.get_object(Bucket=BUCKET, Key=f"deployment/runs/{run_id}/training.html")
    drawn = page["Body"].read().decode()
    assert re.findall(r"<tr><td>(\d+)</td><td>(model|training state)</td>", drawn) == [
        ("40", "training state"),
        ("80", "training state"),
        ("120", "model"),
    ]
    assert "succeeded: step 120 of 120" in drawn
    # `sdq resume --wait` of a train run on the workers follows its steps, not its jobs.
    watched = run_sdq(download_env, "resume", str(run_id), "--wait", cwd=ROOT)
    assert watched.returncode == 0, watched.stderr
    assert re.search(rf"train run {run_id} \S+ 120/120", watched.stderr), watched.stderr
    resumed = sdq_json(download_env, "train", "status", str(run_id))
    assert resumed["losses"] == steady["losses"]
    # Every checkpoint's files are bit-for-bit the uninterrupted run's, and so is the model
    # the last one makes (the others hold the training state only: no validation renders).
    assert [c["state_sha256"] for c in resumed["checkpoints"]] == [
        c["state_sha256"] for c in steady["checkpoints"]
    ]
    assert [c["model_revision"] for c in resumed["checkpoints"]] == [
        None,
        None,
        steady["checkpoints"][-1]["model_revision"],
    ]

    # The second job delivered again (a lost acknowledgement): it finds its step done.
    with psycopg.connect(database_url) as connection:
        connection.execute("UPDATE jobs SET status = 'queued' WHERE id = %s", (jobs[1][0],))
    requeue = run_sdq(download_env, "requeue", str(run_id), cwd=ROOT)
    assert requeue.returncode == 0, requeue.stderr
    wait_for(finished, what="the redelivered job", timeout=120)
    assert len(_jobs(database_url, run_id)) == 3  # no second successor
    again = sdq_json(download_env, "train", "status", str(run_id))
    assert again["checkpoints"] == resumed["checkpoints"]
    assert again["losses"] == resumed["losses"]

    # The uninterrupted run's checkpoints each rendered its validation prompt on the
    # generate queue, from that checkpoint's model.
    def rendered() -> bool:
        with psycopg.connect(database_url) as connection:
            return connection.execute(
                "SELECT count(*) FILTER (WHERE j.status = 'succeeded'), "
                "array_agg(DISTINCT j.spec->>'model_revision') FROM runs r "
                "JOIN jobs j ON j.run_id = r.id WHERE (r.options->>'validation_of')::int = %s",
                (steady["run_id"],),
            ).fetchone() == (3, sorted(c["model_revision"] for c in steady["checkpoints"]))

    wait_for(rendered, what="the validation renders", timeout=180)
    # Its page, opened from S3 by its presigned link, shows them: linked presigned too.
    page = sdq_json(download_env, "train", "status", str(steady["run_id"]))["page"]
    assert page.startswith("http://") and "Signature=" in page
    with chromium() as browser:
        assert open_page(browser, page, tmp_path / "training.png") == [True] * 3


def test_phases_checkpoints_and_the_recipe_on_one_machine(tmp_path: Path) -> None:
    """A pre-training's shape, embedded: phase 1 at 64 px on 2 data-parallel ranks with the
    recipe's options and its state sharded over them (each rank writes its part of every
    checkpoint), phase 2 going on from it at 128 px, a U-Net from scratch; the checkpoints
    each keeps, and the lineage from an image back through both phases."""
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    with HostileServer() as server:
        listing = write_list(tmp_path / "toy.csv", server.base, 12)
        sdq_json(
            env, "download", str(listing), "--dataset", "toy", "--resolution", "64",
            "--rows-per-shard", "6", cwd=tmp_path,
        )  # fmt: skip
    for resolution in ("64", "128"):
        encoded = run_sdq(
            env, "encode", "toy", "--model", "tiny", "--resolution", resolution, cwd=tmp_path
        )
        assert encoded.returncode == 0, encoded.stderr
    assert "holds 64 px images: encoding them at 128 px upscales them" in encoded.stderr

    phase1 = sdq_json(
        env, "train", "toy", "--base", "tiny", "--resolution", "64", "--batch-size", "4",
        "--steps", "6", "--checkpoint-every", "2", "--world-size", "2", "--sharding", "full",
        "--grad-accumulation", "2", "--max-grad-norm", "1", "--lr-schedule", "cosine",
        "--lr-warmup", "2", "--caption-dropout", "0.2", "--noise-offset", "0.05",
        "--keep-checkpoints", "2", "--export-every", "4", "--into", "phase1", cwd=tmp_path,
    )  # fmt: skip
    assert (phase1["status"], phase1["world_size"]) == ("succeeded", 2)
    assert [step for step, _ in phase1["losses"]] == [1, 2, 3, 4, 5, 6]
    held = [
        (c["step"], c["deleted"], c["model_revision"] is not None) for c in phase1["checkpoints"]
    ]
    # Step 2 held the training state only and is gone; 4 is a model (--export-every), 6 too
    # (the last).
    assert held == [(2, True, False), (4, False, True), (6, False, True)]
    store = tmp_path / "sdq-data/store"
    checkpoints = store / f"train/{phase1['run_id']}/checkpoints"
    stored = {
        path.relative_to(checkpoints).parts[:2] for path in checkpoints.rglob("*") if path.is_file()
    }
    assert stored == {
        (kept, part) for kept in ("00000004", "00000006") for part in ("model", "state")
    }
    parts = sorted(path.name for path in (checkpoints / "00000006/state/sharded").iterdir())
    assert parts == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    prompts = tmp_path / "prompts.csv"
    prompts.write_text("prompt,seed\na picture,1\n")
    render = ["--steps", "2", "--dtype", "float32", "--size", "64x64"]
    no_model = run_sdq(env, "run", str(prompts), "--model", "phase1@2", *render, cwd=tmp_path)
    assert no_model.returncode == 2
    assert "phase1@2: no model at step 2" in no_model.stderr
    assert "models at steps: 4, 6" in no_model.stderr

    # A trained model holds its base's VAE and text encoder as they were: the base's latents
    # serve it without encoding again.
    again = sdq_json(
        env, "train", "toy", "--base", "phase1", "--resolution", "64", "--batch-size", "4",
        "--steps", "2", "--checkpoint-every", "2", cwd=tmp_path,
    )  # fmt: skip
    assert again["status"] == "succeeded"

    # So do the latents of any model whose VAE, text encoder and tokenizer files are its own:
    # two folders that differ in their U-Net alone, and one whose VAE differs too.
    pipeline = build_pipeline()
    pipeline.save_pretrained(tmp_path / "encoder-a")
    for part, folder in ((pipeline.unet, "unet-b"), (pipeline.vae, "vae-c")):
        with torch.no_grad():
            next(part.parameters()).add_(0.01)
        pipeline.save_pretrained(tmp_path / folder)
    sdq_json(env, "encode", "toy", "--model", str(tmp_path / "encoder-a"), "--resolution", "64",
             cwd=tmp_path)  # fmt: skip
    twin = sdq_json(
        env, "train", "toy", "--base", str(tmp_path / "unet-b"), "--resolution", "64",
        "--batch-size", "4", "--steps", "2", "--checkpoint-every", "2", cwd=tmp_path,
    )  # fmt: skip
    assert twin["status"] == "succeeded"
    other = run_sdq(env, "train", "toy", "--base", str(tmp_path / "vae-c"), "--resolution", "64",
                    "--steps", "2", cwd=tmp_path)  # fmt: skip
    assert other.returncode == 2 and "dataset 'toy' has no latents made with vae-c" in other.stderr

    phase2 = sdq_json(
        env, "train", "toy", "--resume-from", str(phase1["run_id"]), "--resolution", "128",
        "--batch-size", "4", "--steps", "2", "--checkpoint-every", "2", "--into", "phase2",
        cwd=tmp_path,
    )  # fmt: skip
    assert (phase2["status"], phase2["base"]) == ("succeeded", "tiny")
    image = sdq_json(env, "run", str(prompts), "--model", "phase2", *render, cwd=tmp_path)
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        sources = db.execute(
            "SELECT DISTINCT train_run_id, input_run_id, latent_shard FROM image_sources "
            "WHERE job_id = ?",
            (image["jobs"][0]["id"],),
        ).fetchall()
    # The image's model is phase 2's; it learned from phase 2's 128 px latents and, through
    # the weights it started from, from phase 1's 64 px ones.
    assert {(run, source) for run, source, _ in sources} == {
        (phase2["run_id"], phase2["run_id"]),
        (phase2["run_id"], phase1["run_id"]),
    }
    assert {shard.split("/")[-2][-3:] for _, _, shard in sources} == {"-64", "128"}

    narrow = tmp_path / "narrow-sd2.json"
    narrow.write_text(json.dumps({
        "_class_name": "UNet2DConditionModel", "block_out_channels": [32, 64, 64, 64],
        "attention_head_dim": [2, 4, 4, 4], "cross_attention_dim": 32,
        "use_linear_projection": True, "sample_size": 8,
    }))  # fmt: skip
    scratch = sdq_json(
        env, "train", "toy", "--base", "tiny", "--resolution", "64", "--batch-size", "4",
        "--steps", "2", "--checkpoint-every", "2", "--from-scratch", "--unet-config",
        str(narrow), "--into", "phase1", cwd=tmp_path,
    )  # fmt: skip
    assert scratch["status"] == "succeeded"
    # Trained into phase1 again: phase1@STEP is the newest run's, and a step only an earlier
    # run into the name has is pointed to there, not merely missing.
    hidden = run_sdq(env, "run", str(prompts), "--model", "phase1@4", *render, cwd=tmp_path)
    said = " ".join(hidden.stderr.split())
    assert hidden.returncode == 2 and f"phase1 names run {scratch['run_id']}, the newest" in said
    assert f"earlier runs into phase1 have it: {phase1['run_id']}@4" in said, said
    config = json.loads(
        (
            store / f"train/{scratch['run_id']}/checkpoints/00000002/model/unet/config.json"
        ).read_text()
    )
    assert config["block_out_channels"] == [32, 64, 64, 64] and config["use_linear_projection"]
    unfit = run_sdq(env, "train", "toy", "--base", "tiny", "--resolution", "64", "--steps", "2",
                    "--from-scratch", "--unet-config", "sd2-base", cwd=tmp_path)  # fmt: skip
    assert unfit.returncode == 2
    assert "1024-wide text embeddings; the dataset's latents have 4 channels" in unfit.stderr


def rank_processes(*workers: WorkerProcess) -> list[int]:
    """The rank processes of these workers (named by their local rank as they start): in
    their process groups (a worker's launcher, its Celery processes, their rank fork
    servers and ranks), never another test's or anything else on the machine that trains."""
    return [
        int(pid)
        for worker in workers
        for pid in subprocess.run(
            ["pgrep", "-g", str(worker.process.pid), "-x", r"sdq-rank[0-9]+"],
            capture_output=True, text=True,
        ).stdout.split()
    ]  # fmt: skip


@pytest.mark.slow
def test_two_ranks_resume_exactly_after_a_rank_or_a_worker_dies(
    download_env: dict[str, str], cpu_worker: WorkerProcess, worker: WorkerProcess, tmp_path
) -> None:
    """Two gloo ranks on one node, real processes under real workers. A rank killed mid-job
    fails the job at once (no collective waits on it); a killed worker takes its ranks with
    it. Each time the job goes on from the last checkpoint, and the run ends bit for bit
    where an uninterrupted 2-rank run does, on the 1-rank run's loss curve."""
    database_url = download_env["SDQ_DATABASE_URL"]
    dataset = "train-ranks"
    encoded_dataset(download_env, dataset, 16, tmp_path)
    # Jobs long enough (30 steps) that a rank killed as its job is seen running dies in it.
    run = ["train", dataset, *TRAIN, "--steps", "90", "--checkpoint-every", "30"]
    one = sdq_json(download_env, *run, "--wait")
    steady = sdq_json(download_env, *run, "--world-size", "2", "--wait")
    assert (steady["status"], steady["world_size"]) == ("succeeded", 2)
    assert [loss for _, loss in steady["losses"]] == pytest.approx(
        [loss for _, loss in one["losses"]], rel=1e-4
    )
    # The run done, its ranks are gone; the next run's are forked for it.
    wait_for(lambda: not rank_processes(worker), what="the run's ranks to go", timeout=60)
    run_id = sdq_json(download_env, *run, "--world-size", "2")["run_id"]

    def job_on_ranks(index: int, attempt: int) -> int | None:
        jobs = _jobs(database_url, run_id)
        if len(jobs) <= index or jobs[index][1:3] != ("running", attempt):
            return None
        return jobs[index][0] if len(rank_processes(worker)) >= 2 else None

    wait_for(lambda: job_on_ranks(0, 1), what="the first job", timeout=300)
    # The ranks forked for the run's first job take its next: no process started, no
    # restart, no restore.
    first_ranks = set(rank_processes(worker))
    wait_for(lambda: job_on_ranks(1, 1), what="the second job", timeout=300)
    assert set(rank_processes(worker)) == first_ranks
    os.kill(max(first_ranks), signal.SIGKILL)  # one rank dies, mid-job
    wait_for(lambda: job_on_ranks(1, 2), what="the job sent again", timeout=120)
    time.sleep(1.0)
    job = job_on_ranks(1, 2)
    with psycopg.connect(database_url) as connection:
        holder = connection.execute(
            "SELECT worker_host FROM jobs WHERE id = %s", (job,)
        ).fetchone()[0]
    ranks = set(rank_processes(worker))
    os.kill(int(holder.rsplit(":", 1)[1]), signal.SIGKILL)  # the worker dies
    # Its ranks die with it, whatever they were doing: none is left holding a device (the
    # next attempt's ranks, once its lease runs out, are others).
    wait_for(lambda: not ranks & set(rank_processes(worker)), what="the dead worker's ranks to go",
             timeout=30)  # fmt: skip

    def finished() -> bool:
        jobs = _jobs(database_url, run_id)
        return len(jobs) == 3 and all(status == "succeeded" for _, status, *_ in jobs)

    wait_for(finished, what=f"train run {run_id} to finish", timeout=300)
    assert [attempts for _, _, attempts, _ in _jobs(database_url, run_id)] == [1, 3, 1]
    resumed = sdq_json(download_env, "train", "status", str(run_id))
    assert resumed["losses"] == steady["losses"]
    assert [c["state_sha256"] for c in resumed["checkpoints"]] == [
        c["state_sha256"] for c in steady["checkpoints"]
    ]
    assert (
        resumed["checkpoints"][-1]["model_revision"] == steady["checkpoints"][-1]["model_revision"]
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_over_two_nodes_goes_on_in_memory_and_gathers_again_when_a_node_dies(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    """`--nodes 2` end to end: two train workers as two machines, one rank each. The member
    node's worker is killed (its ranks die with it) as soon as it has joined the first job's
    gang, in its ranks' start-up, and again in the second job, which its gang went on with
    from the first, once its ranks have trained past the job's first step (mid-job: most of
    its 100 are left, its first window of 5 recorded). Each time the leader sees the node
    unseen within seconds (not at the gang's or a collective's timeout, both set far off),
    fails the gathering as an outage, and the job gathers again with a worker started in the
    dead one's place. The third job comes back to the second's leader, and the gang goes on
    with the same rank processes and rendezvous: no restart, no gathering anew. No attempt
    spent, every step trained once in the run's record, on the loss curve of the same run
    on one node."""
    env = {**own_deployment, **DOWNLOAD_ENV, "SDQ_TRAIN_NODE_ADDRESS": "127.0.0.1",
           "SDQ_TRAIN_NODE_TIMEOUT": "5", "SDQ_TRAIN_GANG_TIMEOUT": "900",
           "SDQ_TRAIN_COLLECTIVE_TIMEOUT": "960", "SDQ_TRAIN_LOSS_EVERY": "5",
           # Steps reach the database as taken: the second job is seen early in its 100.
           "SDQ_TRAIN_LIVE_STEPS_SECONDS": "0.5",
           # Two machines on two cores: a thread each, as if each had its own.
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    database_url = env["SDQ_DATABASE_URL"]
    started = [0]

    def train_worker() -> WorkerProcess:
        """A worker on a machine of its own (a host name of its own, its Celery node's)."""
        started[0] += 1
        machine = f"machine{started[0]}"
        return WorkerProcess(env, tmp_path / f"{machine}.log", host=machine).start()

    workers = [train_worker(), train_worker(),
               WorkerProcess(env, tmp_path / "cpu.log", pool="cpu").start()]  # fmt: skip
    try:
        encoded_dataset(env, "gang-birds", 16, tmp_path)
        job_steps = 100  # a second job long enough to be killed in, short enough to run twice
        run = ["train", "gang-birds", *TRAIN, "--steps", str(3 * job_steps), "--world-size", "2",
               "--checkpoint-every", str(job_steps)]  # fmt: skip
        one_node = sdq_json(env, *run, "--wait")
        run_id = sdq_json(env, *run, "--nodes", "2")["run_id"]

        def node(job_index: int, gathering: int, index: int = 1) -> tuple[str, str] | None:
            """The worker and address of that node of the job's gathering."""
            jobs = _jobs(database_url, run_id)
            if len(jobs) <= job_index:
                return None
            with psycopg.connect(database_url) as connection:
                return connection.execute(
                    "SELECT worker, address FROM train_gangs WHERE job_id = %s "
                    "AND gathering = %s AND node = %s",
                    (jobs[job_index][0], gathering, index),
                ).fetchone()

        def member(job_index: int, gathering: int) -> int | None:
            """The pid of the worker process of the job's gathering's node 1."""
            joined = node(job_index, gathering)
            return int(joined[0].rsplit(":", 1)[1]) if joined else None

        def trained_past(step: int) -> bool:
            with psycopg.connect(database_url) as connection:
                [count] = connection.execute(
                    "SELECT count(*) FROM train_steps WHERE run_id = %s AND step > %s",
                    (run_id, step),
                ).fetchone()
            return count > 0

        def kill_worker_of(pid: int) -> None:
            [dead] = [worker for worker in workers if pid in worker.children()]
            os.killpg(dead.process.pid, signal.SIGKILL)
            dead.process.wait()
            workers.remove(dead)
            workers.append(train_worker())

        def succeeded(count: int) -> bool:
            statuses = [status for _, status, *_ in _jobs(database_url, run_id)]
            return statuses[:count] == ["succeeded"] * count

        wait_for(lambda: member(0, 1), what="the first gang's member", timeout=300)
        kill_worker_of(member(0, 1))  # in its ranks' start-up
        wait_for(lambda: member(0, 2), what="the first job's second gathering", timeout=120)
        # The second job's gang went on from the first's; its ranks have recorded their
        # first window of steps.
        wait_for(lambda: member(1, 1) and trained_past(job_steps), what="the second job's steps",
                 timeout=300)  # fmt: skip
        assert [node(1, 1, index) for index in (0, 1)] == [node(0, 2, index) for index in (0, 1)]
        kill_worker_of(member(1, 1))
        wait_for(lambda: member(1, 2), what="the second job's second gathering", timeout=120)

        def gang_ranks() -> set[int]:
            """The rank processes of the two train workers (not the session worker's)."""
            return set(rank_processes(*workers))

        wait_for(lambda: succeeded(2), what="the second job", timeout=300)
        ranks = gang_ranks()  # the gang's, kept for the third job
        wait_for(lambda: member(2, 1), what="the third job's gang", timeout=120)
        assert gang_ranks() == ranks and len(ranks) == 2
        wait_for(lambda: succeeded(3), what=f"train run {run_id} to finish", timeout=300)
    finally:
        for worker in workers:
            worker.stop()
    # The third job went on with the second's gang: its leader, its member and the
    # rendezvous of its rank 0, in one gathering.
    assert [node(2, 1, index) for index in (0, 1)] == [node(1, 2, index) for index in (0, 1)]
    assert node(2, 2) is None
    assert [attempts for _, _, attempts, _ in _jobs(database_url, run_id)] == [1, 1, 1]
    assert events_saying(database_url, run_id, f"%has not been seen for 5 s%({OUTAGE})") == 2
    assert events_saying(database_url, run_id, f"%({OUTAGE})") == 2
    gangs = sdq_json(env, "train", "status", str(run_id))
    assert gangs["losses"] == one_node["losses"]
    assert [c["state_sha256"] for c in gangs["checkpoints"]] == [
        c["state_sha256"] for c in one_node["checkpoints"]
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_job_runs_under_its_worker_s_limits_not_its_sender_s(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    """The train worker's soft time limit is 10 s (a cold worker's first job loads its model
    within it, and each job's last 20% is for its checkpoint, on a machine busy with the
    other tests: at 6 s, the checkpoints went past it); the submit runs with the default 30
    minutes. The worker's limit is the one its jobs run under (each stops for it and
    checkpoints early), not the one the sending process would have stamped on them. The
    worker takes 1 rank at most: a run of 2 goes dead, and `--wait` fails saying why."""
    worker_env = {**own_deployment, **DOWNLOAD_ENV, "SDQ_TRAIN_TASK_SOFT_TIME_LIMIT": "10",
                  "SDQ_TRAIN_TASK_TIME_LIMIT": "600", "SDQ_TRAIN_LOSS_EVERY": "5",
                  "SDQ_TRAIN_RANKS": "1"}  # fmt: skip
    # Beat, as a deployment runs it: a job whose next message a soft limit cut off (the
    # limit lands wherever the task is, a database call included) is sent again.
    healing = {**worker_env, "SDQ_MAINTENANCE_INTERVAL_SECONDS": "1",
               "SDQ_RELAY_AFTER_SECONDS": "10"}  # fmt: skip
    workers = [WorkerProcess(worker_env, tmp_path / "gpu.log").start(),
               WorkerProcess(worker_env, tmp_path / "cpu.log", pool="cpu").start(),
               BeatProcess(healing, tmp_path / "beat.log").start()]  # fmt: skip
    try:
        env = {**own_deployment, **DOWNLOAD_ENV}
        encoded_dataset(env, "limit-birds", 8, tmp_path)
        # Jobs of 10 s and their starts: minutes on a machine busy with other tests. 1,200
        # steps are more than one job's 8 s of them, even at 4 ms a step.
        run = sdq_json(env, "train", "limit-birds", *TRAIN, "--steps", "1200",
                       "--checkpoint-every", "1200", "--wait", timeout=600)  # fmt: skip
        refused = run_sdq(env, "train", "limit-birds", *TRAIN, "--steps", "2", "--world-size", "2",
                          "--wait", cwd=ROOT, timeout=240)  # fmt: skip
    finally:
        for worker in workers:
            worker.stop()
    steps = [checkpoint["step"] for checkpoint in run["checkpoints"]]
    assert len(steps) > 1 and steps[-1] == 1200 and run["status"] == "succeeded"
    assert all(step % 5 == 0 for step in steps)
    assert refused.returncode == 1, refused.stderr
    assert (
        "1 job dead; the first, job" in refused.stderr
        and "trains on 2 ranks a node" in refused.stderr
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_train_run_survives_an_object_store_outage_without_spending_attempts(
    own_deployment: dict[str, str], s3: dict[str, str], tmp_path: Path
) -> None:
    """The object store goes away for 30 s while the second job trains, through its
    checkpoint's upload and the next job's start: each job waits the outage out as one,
    with no attempt spent, and the run ends as it would have."""
    upstream = int(s3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    with OutageProxy(upstream) as proxy:
        # Retries back off (doubling, full jitter) to 5 s at most: with the default ten
        # minutes, a job back from the outage waited as long as its last countdown, which
        # grew with how many retries a fast machine fitted into the 30 s.
        env = {**own_deployment, **DOWNLOAD_ENV, "SDQ_STORE_URL": f"s3://{BUCKET}/outage",
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
               "SDQ_RETRY_BACKOFF_SECONDS": "1", "SDQ_RETRY_BACKOFF_MAX_SECONDS": "5"}  # fmt: skip
        workers = [WorkerProcess(env, tmp_path / "gpu.log").start(),
                   WorkerProcess(env, tmp_path / "cpu.log", pool="cpu").start()]  # fmt: skip
        try:
            encoded_dataset(env, "outage-birds", 8, tmp_path)
            run_id = sdq_json(env, "train", "outage-birds", *TRAIN, "--steps", "60",
                              "--checkpoint-every", "20")["run_id"]  # fmt: skip
            database_url = env["SDQ_DATABASE_URL"]
            wait_for(lambda: [status for _, status, *_ in _jobs(database_url, run_id)][1:2]
                     == ["running"], what="the second train-shard job", timeout=300)  # fmt: skip
            proxy.outage()
            time.sleep(30)
            proxy.restore()
            wait_for(lambda: len(_jobs(database_url, run_id)) == 3 and all(
                status == "succeeded" for _, status, *_ in _jobs(database_url, run_id)),
                what=f"train run {run_id} to finish", timeout=300)  # fmt: skip
        finally:
            for worker in workers:
                worker.stop()
    assert [attempts for _, _, attempts, _ in _jobs(database_url, run_id)] == [1, 1, 1]
    # The outage was met, and waited out as one.
    assert events_saying(database_url, run_id, f"%({OUTAGE})") >= 1
    status = sdq_json(env, "train", "status", str(run_id))
    assert [step for step, _ in status["losses"]] == list(range(1, 61))
    assert status["checkpoints"][-1]["model_revision"]


def test_on_one_machine_the_bar_counts_steps_and_a_stopped_run_promises_nothing(
    tmp_path: Path,
) -> None:
    """Embedded: the bar counts steps, the hint renders with `sdq run`; Ctrl-C leaves a run
    that `sdq train status` shows with no time left and where it goes on from, and whose
    job counts add up to its total; `sdq resume` finishes it, counting steps. Ctrl-C while
    the next job's steps are taken ahead stops them quietly."""
    # Steps reach the database 5 at a time, each 5 as taken: a job's steps show before its
    # checkpoint does, and where the job stands.
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT), "SDQ_TRAIN_LOSS_EVERY": "5",
           "SDQ_TRAIN_LIVE_STEPS_SECONDS": "0.01"}  # fmt: skip
    with HostileServer() as server:
        listing = write_list(tmp_path / "toy.csv", server.base, 8)
        sdq_json(env, "download", str(listing), "--dataset", "toy", "--resolution", "64",
                 cwd=tmp_path)  # fmt: skip
    sdq_json(env, "encode", "toy", "--model", "tiny", "--resolution", "64", cwd=tmp_path)

    def train(*args: str) -> list[str]:
        return [sys.executable, "-m", "sdq.producer.cli", "train", "toy", *TRAIN, *args]

    short = subprocess.run(train("--steps", "6", "--checkpoint-every", "3"), env=env,
                           cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert short.returncode == 0, short.stderr
    assert "6/6" in short.stderr and "2/2" not in short.stderr  # steps, not its two jobs
    short_run = int(re.search(r"train run (\d+)", short.stdout)[1])
    said = " ".join(short.stdout.split())
    # Only the last checkpoint is a model (no validation prompts, no --export-every).
    assert f"render with: sdq run PROMPTS --model {short_run}@STEP (STEP: 6)" in said
    run_id = short_run + 1
    page = (tmp_path / f"sdq-data/store/runs/{short_run}/training.html").read_text()
    assert "<polyline" in page and "Validation images" not in page  # none asked for
    assert "<h2>Learning rate</h2><svg" in page  # its schedule, step by step
    # Its speed and its checkpoints, as `sdq train status` gives them.
    assert re.search(r"<p>[\d.]+ samples/s", page)
    assert "<td>3</td><td>training state</td>" in page and "<td>6</td><td>model</td>" in page

    database = tmp_path / "sdq-data/sdq.db"
    running = subprocess.Popen(
        train("--steps", "400", "--checkpoint-every", "40", "--json"), env=env, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def training() -> bool:
        """Past its first job (the model loaded and checkpointed), early in a job whose
        steps reach the database as they are taken, ahead of its checkpoint: the job is in
        hand when Ctrl-C comes, and later jobs are still to be sent."""
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
            [running, stepped, checkpointed] = db.execute(
                "SELECT (SELECT count(*) FROM jobs WHERE run_id = ? AND status = 'running'), "
                "(SELECT max(step) FROM train_steps WHERE run_id = ?), "
                "(SELECT max(step) FROM checkpoints WHERE run_id = ?)", (run_id,) * 3,
            ).fetchone()  # fmt: skip
        early = 40 <= (checkpointed or 0) <= 200
        return running == 1 and early and checkpointed < stepped <= checkpointed + 20

    wait_for(training, what="the second train-shard job's steps", timeout=240)
    running.send_signal(signal.SIGINT)
    stderr = said_after(running, timeout=120)
    assert running.returncode == 130, stderr
    assert "1 job in hand put back" in " ".join(stderr.split())
    stopped = sdq_json(env, "train", "status", str(run_id), cwd=tmp_path)
    # Its job in hand went back to the queue, which only `sdq resume` works on here.
    assert (stopped["status"], stopped["eta_seconds"]) == ("queued", None)
    shown = run_sdq(env, "train", "status", str(run_id), cwd=tmp_path)
    # The steps taken past its last checkpoint are taken again: it says from where.
    last = stopped["checkpoint_step"]
    assert stopped["step"] > last and last >= 40
    # A resumed run's bar starts from there, not from the steps that will be taken again.
    with session_factory(make_engine(f"sqlite:///{database}"))() as session:
        assert latest_step(session, run_id) == stopped["step"]
        assert latest_step(session, run_id, since=datetime.now(UTC)) == last
    assert f"(goes on from its checkpoint at step {last})" in " ".join(shown.stdout.split())
    assert stopped["samples_per_second"]  # it has a speed; nothing works at it
    counted = sdq_json(env, "status", str(run_id), cwd=tmp_path)
    assert sum(counted["counts"].values()) == counted["total"] == 10
    assert counted["counts"]["planned"] > 0 and counted["eta_seconds"] is None
    # `sdq resume` trains the rest here, its bar counting steps as `sdq train`'s does.
    resumed = run_sdq(env, "resume", str(run_id), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "400/400" in resumed.stderr and "10/10" not in resumed.stderr
    assert f"train run {run_id} (succeeded): step 400 of 400" in resumed.stdout

    # Ctrl-C as the next job's steps are taken ahead, on a thread, from the checkpoint just
    # written (a window of 100 steps here, the job's all, which the job waits for): they
    # stop before the process ends, and quietly. An exit shuts the thread pools they draw
    # on first: their next step failed on them, and said so.
    ahead_run = run_id + 1
    ahead = subprocess.Popen(
        train("--steps", "300", "--checkpoint-every", "100"), cwd=tmp_path, text=True,
        env={**env, "SDQ_TRAIN_LOSS_EVERY": "100"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip

    def waits_for_its_steps() -> bool:
        """The first job done, the second in hand: its steps are being taken ahead."""
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
            statuses = db.execute("SELECT status FROM jobs WHERE run_id = ? ORDER BY id",
                                  (ahead_run,)).fetchall()  # fmt: skip
        return statuses == [("succeeded",), ("running",)]

    wait_for(waits_for_its_steps, what="the second job", timeout=240)
    ahead.send_signal(signal.SIGINT)
    stderr = said_after(ahead, timeout=120)
    assert ahead.returncode == 130 and "1 job in hand put back" in stderr, stderr
    assert "failed" not in stderr and "Traceback" not in stderr, stderr

    # Cancelled, the run has ended: its last job is not made, and its status says how to go on.
    assert sdq_json(env, "cancel", str(ahead_run), cwd=tmp_path)["cancelled"] == 1
    ended = sdq_json(env, "status", str(ahead_run), cwd=tmp_path)
    assert ended["finished"] and ended["counts"] == {"cancelled": 1, "planned": 1, "succeeded": 1}
    shown = " ".join(run_sdq(env, "status", str(ahead_run), cwd=tmp_path).stdout.split())
    assert (f"1 job not made: the run stopped at a job that did not succeed; `sdq retry "
            f"{ahead_run}` goes on from it") in shown  # fmt: skip

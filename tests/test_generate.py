"""Submit -> Redis -> a real worker process -> S3 -> Postgres, end to end."""

import hashlib
import html
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from datetime import UTC, timedelta
from pathlib import Path
from urllib.request import urlopen

import pytest
from PIL import Image
from sqlalchemy import event, func, select, update

from sdq.models.db import make_engine, session_factory
from sdq.models.generate.specs import GenerationSpec
from sdq.models.generate.tables import Generation
from sdq.models.jobs.claims import cancel_jobs
from sdq.models.jobs.kinds import GENERATE
from sdq.models.registry import tiny_identity
from sdq.models.settings import Settings
from sdq.models.tables import Job, JobEvent, JobStatus
from sdq.producer.display import STALLED_SECONDS
from sdq.producer.generate.plan import Defaults, plan_jobs
from sdq.producer.generate.submit import CHUNK, Batching, record_run
from sdq.producer.prompts import read_prompts
from sdq.workers.app import create_app
from tests.conftest import BUCKET, ROOT, write
from tests.services import said_after, wait_for

# Its tests share a module-wide fixture: in one test process when run in parallel.
pytestmark = pytest.mark.xdist_group("test_generate")

# A run of this many one-job messages takes seconds to send: time to press Ctrl-C during it.
SENT = 20_000


@pytest.fixture(scope="module")
def sessions(migrated_postgres: str):
    return session_factory(make_engine(migrated_postgres))


def submit(sdq, path: Path, *args: str) -> dict:
    result = sdq("submit", str(path), "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def wait_for_run(sdq, run_id: int) -> dict:
    status: dict = {}

    def finished() -> bool:
        nonlocal status
        result = sdq("status", str(run_id), "--json")
        assert result.exit_code == 0, result.output
        status = json.loads(result.stdout)
        return status["finished"]

    wait_for(finished, what=f"run {run_id}", timeout=240)
    return status


def s3_object(s3_client, uri: str) -> bytes:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    assert bucket == BUCKET
    return s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()


def test_submit_renders_stores_and_records(worker, sdq, sessions, s3_client, tmp_path) -> None:
    prompts = write(
        tmp_path / "grid.csv",
        'prompt,negative_prompt,seed\n"e2e lighthouse, at dusk",fog,11\ne2e fox in snow,,22\n',
    )
    styles = write(tmp_path / "styles.txt", "ink\noil paint\npixel art\n")
    submitted = submit(sdq, prompts, "--styles", str(styles), "--template", "{prompt} by {style}",
                       "--steps", "4", "--batch-size", "4")  # fmt: skip
    assert submitted["jobs"] == 6 and submitted["tasks"] == 1 and submitted["cached"] == 0
    status = wait_for_run(sdq, submitted["run_id"])
    assert status["counts"] == {"succeeded": 6}
    assert len(status["jobs"]) == 6 and all(
        job["uri"].startswith("s3://") for job in status["jobs"]
    )

    with sessions() as session:
        jobs = session.scalars(select(Job).where(Job.run_id == submitted["run_id"])).all()
        prompts = session.scalars(
            select(Generation.prompt).where(Generation.job_id.in_([job.id for job in jobs]))
        )
        assert sorted(prompts) == sorted(
            f"{subject} by {style}"
            for subject in ("e2e lighthouse, at dusk", "e2e fox in snow")
            for style in ("ink", "oil paint", "pixel art")
        )
        for job in jobs:
            png = s3_object(s3_client, job.output_uri)
            assert job.output_uri.endswith(f"/deployment/images/{job.spec_hash}.png")
            assert job.output_sha256 == hashlib.sha256(png).hexdigest()
            assert job.attempts == 1 and not job.cached
            assert job.worker_host and job.device == "cpu"
            assert job.started_at and job.finished_at and job.work_seconds > 0
            image = Image.open(io.BytesIO(png))
            assert image.size == (64, 64)
            embedded = GenerationSpec.from_dict(json.loads(image.text["sdq-spec"]))
            assert embedded.to_dict() == job.spec and embedded.hash() == job.spec_hash
            assert image.text["sdq-spec-hash"] == job.spec_hash
            assert image.text["parameters"].splitlines()[-1].startswith("Steps: 4, Sampler: Euler")
            assert f"Seed: {job.spec['seed']}," in image.text["parameters"]
            history = session.scalars(
                select(JobEvent.status).where(JobEvent.job_id == job.id).order_by(JobEvent.id)
            ).all()
            assert history[0] == JobStatus.queued and history[-1] == JobStatus.succeeded
            assert JobStatus.running in history


def test_resubmission_is_served_from_cache(worker, sdq, sessions, tmp_path) -> None:
    prompts = write(tmp_path / "p.csv", "prompt,seed\ne2e cached teapot,5\ne2e cached kettle,6\n")
    first = submit(sdq, prompts, "--steps", "3")
    wait_for_run(sdq, first["run_id"])
    second = submit(sdq, prompts, "--steps", "3")
    assert second["cached"] == 2 and second["tasks"] == 0
    status = wait_for_run(sdq, second["run_id"])
    assert status["cached"] == 2 and status["counts"] == {"succeeded": 2}
    original = wait_for_run(sdq, first["run_id"])
    assert sorted(job["uri"] for job in status["jobs"]) == sorted(
        job["uri"] for job in original["jobs"]
    )
    # A different setting is a different spec: rendered, not served.
    third = submit(sdq, prompts, "--steps", "4")
    assert third["cached"] == 0


def test_an_image_the_store_lost_is_rendered_again_not_served(
    worker, sdq, s3_client, tmp_path
) -> None:
    prompts = write(tmp_path / "p.csv", "prompt,seed\ne2e lost lamp,5\ne2e kept lamp,6\n")
    first = wait_for_run(sdq, submit(sdq, prompts, "--steps", "3")["run_id"])
    lost = next(job for job in first["jobs"] if job["prompt"] == "e2e lost lamp")["uri"]
    bucket, _, key = lost.removeprefix("s3://").partition("/")
    made = s3_object(s3_client, lost)
    s3_client.delete_object(Bucket=bucket, Key=key)  # a cleanup the database never heard of

    again = submit(sdq, prompts, "--steps", "3")
    assert again["cached"] == 1  # only the image still in the store is served
    status = wait_for_run(sdq, again["run_id"])
    assert status["counts"] == {"succeeded": 2}
    # Rendered again under the same key; what the record says is what is stored. (Bytes
    # may differ from the first render's in the last bits: that was a batch of two.)
    [job] = [job for job in status["jobs"] if job["uri"] == lost]
    remade = s3_object(s3_client, lost)
    assert remade.startswith(b"\x89PNG") and len(remade) == pytest.approx(len(made), rel=0.2)
    shown = sdq("show", str(job["id"]), "--json")
    assert json.loads(shown.stdout)["cached"] is False


def test_a_duplicated_message_is_harmless(worker, sdq, sessions, service_env, tmp_path) -> None:
    prompts = write(tmp_path / "p.csv", "prompt,seed\ne2e duplicated owl,9\n")
    submitted = submit(sdq, prompts, "--steps", "3")
    app = create_app(Settings.from_env(service_env))
    with sessions() as session:
        job_ids = session.scalars(select(Job.id).where(Job.run_id == submitted["run_id"])).all()
    # The same batch delivered twice more, as a broker may after a lost acknowledgement.
    app.send_task(GENERATE.task_name, args=[list(job_ids)])
    app.send_task(GENERATE.task_name, args=[list(job_ids)])
    wait_for_run(sdq, submitted["run_id"])
    time.sleep(3)  # let the extra deliveries arrive and find nothing to do
    with sessions() as session:
        job = session.get(Job, job_ids[0])
        renders = session.scalar(
            select(func.count()).where(
                JobEvent.job_id == job.id, JobEvent.status == JobStatus.succeeded
            )
        )
        assert (job.status, job.attempts, renders) == (JobStatus.succeeded, 1, 1)


def test_requeue_sends_what_never_reached_the_broker(
    worker, sdq, sessions, service_env, tmp_path
) -> None:
    prompts = write(tmp_path / "p.csv", "prompt,seed\ne2e outbox heron,3\ne2e outbox crane,4\n")
    # A broker nobody listens on: the run is saved, the messages are not sent.
    down = sdq(
        "submit", str(prompts), "--steps", "3", env={"SDQ_BROKER_URL": "redis://127.0.0.1:1/0"}
    )
    assert down.exit_code != 0 and "sdq requeue" in down.output
    with sessions() as session:
        run_id = session.scalar(select(func.max(Job.run_id)))
        statuses = session.scalars(select(Job.status).where(Job.run_id == run_id)).all()
    assert statuses == [JobStatus.pending, JobStatus.pending]
    requeued = sdq("requeue", str(run_id), "--json")
    assert requeued.exit_code == 0, requeued.output
    assert json.loads(requeued.stdout)["jobs"] == 2
    assert wait_for_run(sdq, run_id)["counts"] == {"succeeded": 2}


def test_cancel_stops_what_has_not_started(sdq, sessions, tmp_path) -> None:
    """What no worker holds is cancelled; a job on a lease not run out is left to finish,
    and cancel says until when; once the lease has run out (its worker gone), it is taken."""
    prompts = write(tmp_path / "p.csv", "prompt,seed\ne2e cancelled moth,3\ne2e held moth,4\n")
    down = sdq("submit", str(prompts), env={"SDQ_BROKER_URL": "redis://127.0.0.1:1/0"})
    assert down.exit_code != 0
    with sessions.begin() as session:
        run_id = session.scalar(select(func.max(Job.run_id)))
        held = session.scalar(select(func.max(Job.id)).where(Job.run_id == run_id))
        lease = update(Job).where(Job.id == held)
        ahead = func.now() + timedelta(minutes=5)
        session.execute(lease.values(status=JobStatus.running, lease_expires_at=ahead))
        until = session.scalar(select(Job.lease_expires_at).where(Job.id == held))
    said = sdq("cancel", str(run_id)).output.split("\n")
    assert said[0] == f"run {run_id}: cancelled 1 jobs"
    until_utc = until.astimezone(UTC)
    told = f"1 running on their workers' leases, the last until {until_utc:%H:%M:%S} UTC"
    assert said[1].startswith(told), said
    with sessions.begin() as session:  # its worker gone, the lease runs out
        session.execute(lease.values(lease_expires_at=func.now() - timedelta(seconds=1)))
    gone = json.loads(sdq("cancel", str(run_id), "--json").stdout)
    assert gone == {"run_id": run_id, "cancelled": 1, "running": 0}
    status = json.loads(sdq("status", str(run_id), "--json").stdout)
    assert status["counts"] == {"cancelled": 2} and status["finished_at"]
    assert json.loads(sdq("requeue", str(run_id), "--json").stdout)["jobs"] == 0


def test_lookups(worker, sdq, tmp_path) -> None:
    prompts = write(tmp_path / "p.csv", "prompt,seed,style\ne2e lookup zebra,42,ink\n")
    run_id = submit(sdq, prompts, "--steps", "3")["run_id"]
    job_id = wait_for_run(sdq, run_id)["jobs"][0]["id"]

    found = json.loads(sdq("find", "--prompt", "LOOKUP zeb", "--style", "ink", "--json").stdout)
    assert [row["id"] for row in found] == [job_id]
    assert (
        json.loads(sdq("find", "--prompt", "zebra", "--run", str(run_id + 1000), "--json").stdout)
        == []
    )
    assert (
        json.loads(sdq("find", "--model", "tiny", "--run", str(run_id), "--json").stdout)[0]["seed"]
        == 42
    )

    shown = json.loads(sdq("show", str(job_id), "--json").stdout)
    assert shown["spec"]["seed"] == 42 and shown["spec"]["model_name"] == "tiny"
    assert shown["worker"] and shown["device"] == "cpu" and shown["uri"].startswith("s3://")
    assert [event["status"] for event in shown["events"]][-1] == "succeeded"

    out = tmp_path / "out.png"
    assert sdq("get", str(job_id), "-o", str(out)).exit_code == 0
    assert Image.open(out).text["sdq-spec-hash"] == shown["spec_hash"]
    # A file there already is the user's until --force; a folder that is not there is a typo.
    kept = sdq("get", str(job_id), "-o", str(out))
    assert kept.exit_code == 2 and f"{out} exists: give --force" in kept.output
    out.write_bytes(b"prompt,seed\n")
    assert sdq("get", str(job_id), "-o", str(out), "--force").exit_code == 0
    assert Image.open(out).text["sdq-spec-hash"] == shown["spec_hash"]
    typo = tmp_path / "no-such-folder" / "x.png"
    refused = sdq("get", str(job_id), "-o", str(typo))
    assert refused.exit_code == 2 and "no folder" in refused.output and not typo.parent.exists()
    # An image is named by its spec hash: the hash, a prefix of it, or its path name the job.
    spec_hash = shown["spec_hash"]
    for name in (spec_hash, spec_hash[:8], shown["uri"], f"images/{spec_hash}.png"):
        assert json.loads(sdq("show", name, "--json").stdout)["id"] == job_id, name
    by_hash = tmp_path / "by-hash.png"
    got = json.loads(sdq("get", spec_hash[:10], "-o", str(by_hash), "--json").stdout)
    assert (got["job_id"], got["uri"]) == (job_id, shown["uri"])
    assert by_hash.read_bytes() == out.read_bytes()
    for name, message in [("zz", "names no job"), ("abcdef0123", "no job with a spec hash")]:
        refused = sdq("show", name)
        assert refused.exit_code == 2 and message in refused.output, name

    runs = json.loads(sdq("runs", "--json").stdout)
    assert any(run["run_id"] == run_id for run in runs)
    text = sdq("status", str(run_id)).output
    assert "succeeded" in text and "1 of 1 images done" in text
    missing = sdq("show", "999999")
    assert missing.exit_code == 2 and "no job 999999" in missing.output


@pytest.mark.parametrize(
    ("text", "problems"),
    [
        ("prompt,seed\nfine,1\n,2\nalso fine,-1\n",
         [":3: prompt: empty prompt", ":4: seed: seed must be between 0"]),
        # Postgres cannot store a NUL; it used to end in a driver traceback.
        ("prompt,seed\nfine,1\nnul\x00inside,2\n", [":3: a NUL byte (0x00)"]),
        # An unclosed quote used to swallow every later row into one prompt.
        ("seed,prompt\n1,fine\n2,\"never closed\n3,later\n4,last\n",
         [":3: a quote opened here is never closed"]),
        ("prompt,guidance\nfine,7.5\nhuge,1e308\n",
         [":3: guidance: guidance must be a number from 0 to 100, got 1e308"]),
    ],
)  # fmt: skip
def test_bad_input_is_named_by_line_and_writes_nothing(
    sdq, sessions, tmp_path, text: str, problems: list[str]
) -> None:
    with sessions() as session:
        before = session.scalar(select(func.count()).select_from(Job))
    prompts = write(tmp_path / "bad.csv", text)
    result = sdq("submit", str(prompts))
    assert result.exit_code == 2
    for problem in problems:
        assert f"{prompts}{problem}" in result.output
    assert "nothing was submitted" in result.output
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == before


def test_a_long_run_is_written_in_chunks_and_a_late_bad_row_undoes_them(
    sdq, sessions, tmp_path
) -> None:
    rows = "".join(f"chunked prompt {n},{n}\n" for n in range(2 * CHUNK + 1))
    with sessions() as session:
        before = session.scalar(select(func.count()).select_from(Job))
    # Three chunks are planned (in a thread) and two written before the bad row is read.
    bad = write(tmp_path / "late.csv", f"prompt,seed\n{rows}last one,not a seed\n")
    result = sdq("submit", str(bad))
    assert result.exit_code == 2
    assert f"{bad}:{2 * CHUNK + 3}: seed" in result.output
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == before
    # The same rows without it: every chunk is written, each job with its first history
    # row, and the counter a progress bar follows sees them all.
    good = write(tmp_path / "long.csv", f"prompt,seed\n{rows}")
    written: list[int] = []
    statements: defaultdict[int, list[str]] = defaultdict(list)  # by database connection

    def seen(connection, cursor, statement: str, *rest) -> None:
        statements[id(connection.connection.dbapi_connection)].append(statement)

    event.listen(sessions.kw["bind"], "before_cursor_execute", seen)
    try:
        submission = record_run(
            sessions,
            plan_jobs(read_prompts(good), model=tiny_identity(), defaults=Defaults()),
            model=tiny_identity(),
            source=str(good),
            options={},
            batching=Batching(8, 4),
            on_written=written.append,
        )
    finally:
        event.remove(sessions.kw["bind"], "before_cursor_execute", seen)
    assert written == [CHUNK, CHUNK, 1] and submission.jobs == 2 * CHUNK + 1
    # Past the first chunk (drawn on the writer's own connection, which waits for it), each
    # chunk's ids were drawn and its stored outputs looked up on another connection while
    # the writer's transaction copied the last one in.
    [writer] = [key for key, said in statements.items()
                if any(line.startswith("INSERT INTO runs") for line in said)]  # fmt: skip
    beside = [line for key, said in statements.items() if key != writer for line in said]
    for said, chunks in ((statements[writer], 1), (beside, 2)):
        assert sum("nextval" in line for line in said) == chunks
        assert sum("jobs.spec_hash" in line for line in said) == chunks
    with sessions.begin() as session:
        of_run = Job.run_id == submission.run_id
        queued = select(func.count()).select_from(JobEvent).join(Job).where(of_run)
        assert session.scalar(queued.where(JobEvent.status == JobStatus.queued)) == 2 * CHUNK + 1
        lines = session.scalars(select(Generation.source_line).join(Job).where(of_run)).all()
        assert sorted(lines) == list(range(2, 2 * CHUNK + 3))
        # Never sent: cancelled, so that no later relay in this database takes them for lost.
        cancel_jobs(session, submission.run_id)


def test_a_killed_worker_loses_no_work(worker, sdq, sessions, tmp_path) -> None:
    prompts = write(tmp_path / "p.csv", "prompt,seed\ne2e killed mid-render,13\n")
    run_id = submit(sdq, prompts, "--steps", "400")["run_id"]  # long enough to be cut short

    def claimed() -> Job | None:
        with sessions() as session:
            job = session.scalars(select(Job).where(Job.run_id == run_id)).one()
        return job if job.status == JobStatus.running else None

    wait_for(lambda: claimed() is not None, what="the job to start", timeout=120)
    holder = claimed().worker_host
    os.kill(int(holder.rsplit(":", 1)[1]), signal.SIGKILL)

    status = wait_for_run(sdq, run_id)
    assert status["counts"] == {"succeeded": 1}
    with sessions() as session:
        job = session.scalars(select(Job).where(Job.run_id == run_id)).one()
        history = session.scalars(
            select(JobEvent.status).where(JobEvent.job_id == job.id).order_by(JobEvent.id)
        ).all()
    assert job.attempts == 2 and job.worker_host != holder
    assert history.count(JobStatus.running) == 2 and history[-1] == JobStatus.succeeded


def test_submit_wait_reports_the_end_and_fails_on_dead_jobs(worker, sdq, tmp_path) -> None:
    prompts = write(tmp_path / "p.csv", "prompt,seed\ne2e waited for,8\n")
    waited = sdq("submit", str(prompts), "--steps", "2", "--wait", "--json")
    assert waited.exit_code == 0, waited.output
    status = json.loads(waited.stdout)
    assert status["finished"] and status["counts"] == {"succeeded": 1}

    # A pipeline folder that resolves (its configs are fine) but cannot load (weights are not).
    broken = tmp_path / "broken-model"
    (broken / "scheduler").mkdir(parents=True)
    (broken / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "EulerDiscreteScheduler", "num_train_timesteps": 1000})
    )
    (broken / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    failed = sdq("submit", str(prompts), "--model", str(broken), "--steps", "2", "--wait")
    assert failed.exit_code == 1, failed.output
    assert "1 failed for good" in failed.output
    # The reason is in the summary, grouped, with a job to look at.
    assert re.search(r"1 dead: \w+Error: .+\(e\.g\. `sdq show \d+`\)", failed.output, re.S)


def test_a_model_path_that_is_not_a_pipeline_is_refused_at_submit(sdq, tmp_path) -> None:
    prompts = write(tmp_path / "p.csv", "prompt\nnever rendered\n")
    (tmp_path / "empty-folder").mkdir()
    for model, message in [
        ("./no-such-folder", "no folder ./no-such-folder"),
        (str(tmp_path / "empty-folder"), "is not a diffusers pipeline: no model_index.json"),
    ]:
        result = sdq("submit", str(prompts), "--model", model)
        assert result.exit_code == 2 and message in result.output, result.output


def test_an_s3_gallery_opens_over_http_by_its_presigned_link(worker, sdq, s3_client, tmp_path):
    prompts = write(tmp_path / "p.csv", "prompt,seed\ne2e gallery kite,7\ne2e gallery drum,8\n")
    run = wait_for_run(sdq, submit(sdq, prompts, "--steps", "3")["run_id"])
    result = sdq("gallery", str(run["run_id"]), "--json")
    assert result.exit_code == 0, result.output
    gallery = json.loads(result.stdout)
    assert gallery["gallery"].startswith(f"s3://{BUCKET}/") and gallery["gallery_link"].startswith(
        "http"
    )
    # What a browser does: fetch the page by its link, then every image by the page's links,
    # with no credentials at all.
    page = urlopen(gallery["gallery_link"], timeout=10).read().decode()
    sources = re.findall(r'<img src="([^"]+)"', page)
    assert len(sources) == 2
    fetched = sorted(urlopen(html.unescape(src), timeout=10).read() for src in sources)
    assert fetched == sorted(s3_object(s3_client, job["uri"]) for job in run["jobs"])
    assert ">e2e gallery kite<" in page and "seed 7" in page and "3 steps" in page


def pressed_ctrl_c(command: subprocess.Popen) -> str:
    """Ctrl-C to a command: it ends as a shell reports one stopped by SIGINT, never with
    click's bare "Aborted!". Returns what it said, on one line."""
    command.send_signal(signal.SIGINT)
    stderr = said_after(command, timeout=60)
    assert command.returncode == 130, stderr
    said = " ".join(stderr.split())
    assert "Aborted" not in said
    return said


def test_ctrl_c_while_sending_leaves_the_rest_queued_for_the_relay(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    """Ctrl-C lands while a large run's messages go out: the command says what became of
    the jobs not sent yet (committed, queued, for the relay), not click's bare "Aborted!"."""
    import redis

    prompts = write(tmp_path / "p.csv", "prompt\n" + "".join(f"many {n}\n" for n in range(SENT)))
    sending = subprocess.Popen(
        [sys.executable, "-m", "sdq.producer.cli", "submit", str(prompts), "--batch-size", "1"],
        env={**own_deployment, "SDQ_CALLS_PER_TASK": "1"}, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    broker = redis.Redis.from_url(own_deployment["SDQ_BROKER_URL"])
    wait_for(lambda: broker.llen(GENERATE.queue) > 0, what="the first messages", timeout=120)
    said = pressed_ctrl_c(sending)
    assert "stopped sending: run 1's jobs not sent yet stay queued" in said
    assert "`sdq requeue 1` at once" in said
    assert 0 < broker.llen(GENERATE.queue) < SENT
    with session_factory(make_engine(own_deployment["SDQ_DATABASE_URL"]))() as session:
        statuses = session.execute(select(Job.status, func.count()).group_by(Job.status)).all()
    assert statuses == [(JobStatus.queued, SENT)]


def test_ctrl_c_on_wait_stops_the_watching_not_the_run(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    """No worker here: the wait says so once nothing has moved for a while (the bar alone
    sat at 0 for ever); the run waits in the broker, and goes on waiting after Ctrl-C."""
    prompts = write(tmp_path / "p.csv", "prompt\nwatched\nand left\n")
    watching = subprocess.Popen(
        [sys.executable, "-m", "sdq.producer.cli", "submit", str(prompts), "--wait"],
        env=own_deployment, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    sessions = session_factory(make_engine(own_deployment["SDQ_DATABASE_URL"]))

    def queued() -> bool:
        with sessions() as session:
            return session.scalar(select(func.count()).select_from(Job)) == 2

    wait_for(queued, what="the run's jobs in the broker", timeout=60)
    time.sleep(STALLED_SECONDS + 8)  # watching, nothing moving, the workers asked (2 s)
    said = pressed_ctrl_c(watching)
    assert (
        "no worker consumes the generate queue now: the run waits for one (`sdq worker gpu`" in said
    )
    assert "stopped watching: run 1 goes on on the workers" in said
    assert "`sdq resume 1 --wait` watches it again" in said
    with sessions() as session:
        assert set(session.scalars(select(Job.status))) == {JobStatus.queued}

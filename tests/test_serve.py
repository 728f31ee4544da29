"""`sdq serve`: images on request over HTTP, as OpenAI's clients and sdq's own ask for them,
through the real queue, worker, database and store: each request a run, twins from the
store, keys, limits, bad input named by field, and the lane that takes a request ahead of a
batch run."""

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import psycopg
import pytest
from PIL import Image

from sdq.models.jobs.kinds import GENERATE
from sdq.models.settings import Settings
from sdq.workers.app import create_app
from sdq.workers.delivery import retry_queue
from tests.conftest import ROOT, BeatProcess, WorkerProcess, sdq_json
from tests.services import answers, free_port, listening, wait_for
from tests.test_monitoring import scraped

TINY = {"size": "64x64", "steps": 2}


def hang_up_once_submitted(
    base: str, path: str, headers: dict[str, str], body: dict, submitted: Callable[[], bool]
) -> None:
    """POSTs `body` and closes the connection once its jobs are `submitted`, without waiting
    for the answer: a client that hangs up. (A client gone before its request's body is read
    asked for nothing: the server drops such a request.)"""
    url = httpx.URL(base)
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {url.host}:{url.port}",
            "Content-Type: application/json", f"Content-Length: {len(payload)}",
            *(f"{name}: {value}" for name, value in headers.items()), "", ""]  # fmt: skip
    with socket.create_connection((url.host, url.port)) as connection:
        connection.sendall("\r\n".join(head).encode() + payload)
        wait_for(submitted, what="the request's job", timeout=60)


@contextmanager
def serving(env: dict[str, str], log: Path, *args: str) -> Iterator[str]:
    """`sdq serve` as a user starts it; its base URL once /healthz answers."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "sdq.producer.cli", "serve", "--port", str(port), *args],
        env=env, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: _exited(process, log) or answers(f"{base}/healthz"),
            what=f"sdq serve (log: {log})",
            timeout=60,
        )
        yield base
    finally:
        process.terminate()
        process.wait(30)


def _exited(process: subprocess.Popen, log: Path) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"sdq serve exited: {log.read_text()[-3000:]}")
    return False


def new_key(env: dict[str, str], name: str) -> dict[str, str]:
    key = sdq_json(env, "serve", "keys", "create", name)["key"]
    return {"Authorization": f"Bearer {key}"}


def runs_of(database_url: str, key_name: str) -> list[tuple[int, str]]:
    """The key's runs, each with its jobs' statuses."""
    with psycopg.connect(database_url) as db:
        return db.execute(
            "SELECT runs.id, string_agg(jobs.status, ',' ORDER BY jobs.id) FROM runs "
            "JOIN jobs ON jobs.run_id = runs.id WHERE runs.options->>'api_key' = %s "
            "GROUP BY runs.id ORDER BY runs.id", (key_name,),
        ).fetchall()  # fmt: skip


def png(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def test_a_settled_job_is_told_of_at_the_outermost_commit_only(redis_url: str) -> None:
    """Notes of settled jobs travel once the transaction commits: not at a savepoint's
    release, not at all when it rolls back."""
    import redis
    from sqlalchemy import create_engine, text

    from sdq.models.db import session_factory
    from sdq.models.jobs.notices import channel, note_settled, tell_settled

    sessions = tell_settled(session_factory(create_engine("sqlite://")), redis_url)
    listener = redis.Redis.from_url(redis_url).pubsub()
    listener.subscribe(channel(7), channel(8))
    listener.get_message(timeout=5)
    listener.get_message(timeout=5)  # the two subscriptions' own confirmations

    def heard() -> list[bytes]:
        messages = []
        while (message := listener.get_message(timeout=0.5)) is not None:
            messages.append(message["channel"])
        return messages

    with sessions.begin() as session:
        with session.begin_nested():
            session.execute(text("SELECT 1"))
            note_settled(session, [7])
        assert heard() == []  # the savepoint released; the transaction goes on
    assert heard() == [channel(7).encode()]
    with pytest.raises(RuntimeError), sessions.begin() as session:
        note_settled(session, [8])
        raise RuntimeError("rolled back")
    with sessions.begin() as session:
        session.execute(text("SELECT 1"))
    assert heard() == []


def test_images_on_request_each_a_run_twins_from_the_store_and_jobs_with_events(
    service_env: dict[str, str], worker: WorkerProcess, tmp_path: Path
) -> None:
    env = {**service_env, "SDQ_SERVE_MAX_IMAGES": "4"}
    alice = new_key(env, "alice")
    ask = {"prompt": "a red fox in the snow", "n": 2, "seed": 11, **TINY}
    counted_before = scraped(env, {"sdq_serve_request_seconds"})
    with (
        serving(env, tmp_path / "serve.log") as base,
        httpx.Client(base_url=base, timeout=120) as http,
    ):
        assert http.post("/v1/images/generations", json=ask).status_code == 401
        wrong = {"Authorization": "Bearer sdq_not-a-key"}
        assert http.post("/v1/images/generations", json=ask, headers=wrong).status_code == 401

        # OpenAI's request as its clients send it (its own optional fields accepted).
        openai = {"response_format": "b64_json", "quality": "hd", "user": "u1"}
        asked = http.post("/v1/images/generations", headers=alice, json={**ask, **openai})
        assert asked.status_code == 200, asked.text
        answer = asked.json()
        images = [png(base64.b64decode(entry["b64_json"])) for entry in answer["data"]]
        assert [image.size for image in images] == [(64, 64)] * 2
        assert images[0].tobytes() != images[1].tobytes()  # seeds 11 and 12
        database = env["SDQ_DATABASE_URL"]
        assert runs_of(database, "alice") == [(answer["run_id"], "succeeded,succeeded")]

        # The same request again: its images come from the store, as URLs this time.
        again = http.post("/v1/images/generations", headers=alice, json=ask)
        assert again.status_code == 200, again.text
        with psycopg.connect(database) as db:
            cached = db.execute("SELECT bool_and(cached) FROM jobs WHERE run_id = %s",
                                (again.json()["run_id"],)).fetchone()[0]  # fmt: skip
        assert cached
        fetched = [httpx.get(entry["url"]).content for entry in again.json()["data"]]
        assert [png(data).tobytes() for data in fetched] == [image.tobytes() for image in images]

        # Jobs answered at once, followed by their events and their record.
        queued = http.post("/v1/jobs", headers=alice, json={**ask, "n": 1, "seed": 99})
        assert queued.status_code == 202, queued.text
        [job_id] = queued.json()["job_ids"]
        with http.stream("GET", f"/v1/jobs/{job_id}/events", headers=alice) as stream:
            events = [line.removeprefix("event: ") for line in stream.iter_lines()
                      if line.startswith("event: ")]  # fmt: skip
        # Each state once, in order, ending done (a fast job may skip the first ones).
        order = ["queued", "running", "done"]
        assert events[-1] == "done" and events == sorted(set(events), key=order.index)
        record = http.get(f"/v1/jobs/{job_id}", headers=alice).json()
        assert record["status"] == "succeeded" and record["work_seconds"] > 0
        # Another key does not see alice's jobs; an image's URL needs no key, as S3's.
        other = new_key(env, "alice-neighbour")
        assert http.get(f"/v1/jobs/{job_id}", headers=other).status_code == 404
        assert http.get(f"/v1/jobs/{job_id}/events", headers=other).status_code == 404
        image = http.get(record["url"])
        assert image.headers["content-type"] == "image/png" and png(image.content).size == (64, 64)
        assert http.get("/v1/jobs/999999999", headers=alice).status_code == 404

        assert "/v1/images/generations" in http.get("/openapi.json").json()["paths"]
    # Each request's latency by route and status, every replica's, at `sdq metrics`; and
    # the requests in flight (none now).
    counted = scraped(env, {"sdq_serve_request_seconds", "sdq_serve_requests_in_flight"})
    for status, requests in (("200", 2), ("401", 2)):
        labels = (("route", "/v1/images/generations"), ("status", status))
        made = ("sdq_serve_request_seconds_count", labels)
        assert counted[made] - counted_before.get(made, 0) == requests
        within = ("sdq_serve_request_seconds_bucket", (("le", "120"), *labels))
        assert counted[within] == counted[made]  # every one answered within 2 minutes
    assert counted[("sdq_serve_requests_in_flight", ())] == 0

    # A client that hangs up leaves its job to finish: the image is made and stored, and
    # the same request later is answered from the store.
    left = {"prompt": "asked for and left behind", "seed": 5, "size": "64x64", "steps": 80}
    with serving(env, tmp_path / "serve-2.log") as base, httpx.Client(base_url=base) as http:

        def left_job() -> tuple[str] | None:
            with psycopg.connect(database) as db:
                return db.execute(
                    "SELECT j.status FROM jobs j JOIN generations g ON g.job_id = j.id "
                    "WHERE g.prompt = %s", (left["prompt"],),
                ).fetchone()  # fmt: skip

        hang_up_once_submitted(base, "/v1/images/generations", alice, left,
                               submitted=lambda: left_job() is not None)  # fmt: skip
        wait_for(lambda: left_job() == ("succeeded",), what="the left request's image",
                 timeout=120)  # fmt: skip
        later = http.post("/v1/images/generations", headers=alice, json=left, timeout=120)
        assert later.status_code == 200, later.text
    with psycopg.connect(database) as db:
        assert db.execute("SELECT bool_and(cached) FROM jobs WHERE run_id = %s",
                          (later.json()["run_id"],)).fetchone() == (True,)  # fmt: skip


def test_bad_requests_are_named_by_field_and_write_nothing(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    # n past the limit is refused as such (422), though it would pass the key's room in
    # flight too: a 429 would have its client wait for ever.
    env = {**service_env, "SDQ_SERVE_MAX_IMAGES": "4", "SDQ_SERVE_MAX_STEPS": "50",
           "SDQ_SERVE_IMAGES_IN_FLIGHT": "4"}  # fmt: skip
    bob = new_key(env, "bob")
    good = {"prompt": "a castle", **TINY}
    refused = [
        ({**good, "colour": "red"}, 422, "colour"),  # neither sdq's nor OpenAI's
        ({**good, "size": "65x64"}, 422, "size"),
        ({**good, "n": 5}, 422, "n"),
        ({**good, "steps": 51}, 422, "steps"),
        ({**good, "response_format": "jpeg"}, 422, "response_format"),
        ({**good, "prompt": ""}, 422, "prompt"),
        ({**good, "model": "no-such-model"}, 404, "model"),
        ({**good, "lora": ["no-such-lora"]}, 404, "lora"),
        # The server's files are not named over HTTP, nor another bucket.
        ({**good, "model": "/etc"}, 422, "model"),
        ({**good, "model": "../sdq-data"}, 422, "model"),
        ({**good, "model": "s3://someone-else/model"}, 422, "model"),
        ({**good, "model": "tests"}, 404, "model"),  # a folder where the service runs
        ({**good, "lora": ["tests/../tests/fixture.safetensors:0.5"]}, 422, "lora"),
        ({**good, "lora": ["lora.safetensors:1"]}, 404, "lora"),  # a name, and no such one
    ]
    with (
        serving(env, tmp_path / "serve.log") as base,
        httpx.Client(base_url=base, timeout=60) as http,
    ):
        for body, status, field in refused:
            answer = http.post("/v1/jobs", headers=bob, json=body)
            assert (answer.status_code, answer.json()["error"]["param"]) == (status, field), body
        malformed = http.post("/v1/jobs", headers={**bob, "Content-Type": "application/json"},
                              content=b'{"prompt": "a castle",')  # fmt: skip
        said = malformed.json()["error"]
        assert malformed.status_code == 422 and said["param"] == "body", said
        assert said["message"].startswith("body: not JSON: ") and "character 22" in said["message"]
        huge = http.post("/v1/jobs", headers=bob, json={"prompt": "x" * (1 << 20)})
        assert huge.status_code == 413
    assert runs_of(env["SDQ_DATABASE_URL"], "bob") == []


def test_limits_per_key_a_revoked_key_and_an_outage(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    """No worker here: images stay in flight. Its own Redis (the broker), stopped midway:
    503 with Retry-After, and nothing written."""
    port = free_port()
    redis_server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "",
                                     "--appendonly", "no"], stdout=subprocess.DEVNULL)  # fmt: skip
    env = {**own_deployment, "SDQ_BROKER_URL": f"redis://127.0.0.1:{port}/0",
           "SDQ_SERVE_IMAGES_IN_FLIGHT": "5", "SDQ_SERVE_REQUESTS_PER_MINUTE": "20"}  # fmt: skip
    carol, dave = new_key(env, "carol"), new_key(env, "dave")
    try:
        wait_for(lambda: listening(port), what="this test's Redis")
        with (
            serving(env, tmp_path / "serve.log") as base,
            httpx.Client(base_url=base, timeout=60) as http,
        ):
            first = http.post("/v1/jobs", headers=carol, json={"prompt": "a", "n": 4, **TINY})
            assert first.status_code == 202, first.text
            full = http.post("/v1/jobs", headers=carol, json={"prompt": "b", "n": 2, **TINY})
            assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
            assert "in flight" in full.json()["error"]["message"]
            never = http.post("/v1/jobs", headers=carol, json={"prompt": "c", "n": 6, **TINY})
            assert (never.status_code, never.json()["error"]["param"]) == (422, "n"), never.text
            # Requests that come together cannot all pass the cap: room is taken at once.
            erin = new_key(env, "erin")
            with ThreadPoolExecutor(4) as clients:
                together = list(clients.map(
                    lambda n: http.post("/v1/jobs", headers=erin,
                                        json={"prompt": f"e{n}", "n": 2, **TINY}).status_code,
                    range(4),
                ))  # fmt: skip
            assert sorted(together) == [202, 202, 429, 429], together
            # Another key has room of its own; past its requests a minute, it waits.
            said = [http.get("/v1/jobs/1", headers=dave).status_code for _ in range(21)]
            assert 429 not in said[:20] and said[20] == 429
            assert sdq_json(env, "serve", "keys", "revoke", "carol")["revoked"]
            assert http.get("/v1/jobs/1", headers=carol).status_code == 401
            redis_server.kill()
            redis_server.wait()
            out = http.post("/v1/jobs", headers=dave, json={"prompt": "c", **TINY})
            assert out.status_code == 503 and out.headers["Retry-After"], out.text
    finally:
        redis_server.kill()
    assert [statuses for _, statuses in runs_of(env["SDQ_DATABASE_URL"], "carol")] == [
        "queued,queued,queued,queued"
    ]
    assert runs_of(env["SDQ_DATABASE_URL"], "dave") == []
    listed = {row["name"]: row for row in sdq_json(env, "serve", "keys", "list")}
    assert listed["carol"]["revoked_at"] and listed["dave"]["revoked_at"] is None


def test_a_request_whose_jobs_are_cancelled_is_answered_when_they_are(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    """No worker: the request waits. `sdq cancel` settles its jobs outside any worker's
    delivery; the notice of it reaches the waiting request, which answers the cancellation
    then, not 202 at its deadline."""
    env = {**own_deployment, "SDQ_SERVE_WAIT_SECONDS": "600"}
    frank = new_key(env, "frank")
    with (
        serving(env, tmp_path / "serve.log") as base,
        httpx.Client(base_url=base, timeout=660) as http,
        ThreadPoolExecutor(1) as client,
    ):
        asked = client.submit(http.post, "/v1/images/generations", headers=frank,
                              json={"prompt": "never drawn", "n": 2, **TINY})  # fmt: skip
        wait_for(lambda: runs_of(env["SDQ_DATABASE_URL"], "frank"), what="the request's run")
        [(run_id, _)] = runs_of(env["SDQ_DATABASE_URL"], "frank")
        assert sdq_json(env, "cancel", str(run_id))["cancelled"] == 2
        answer = asked.result()
    assert answer.status_code == 500, answer.text
    assert "cancelled" in answer.json()["error"]["message"]


@pytest.mark.slow
def test_a_request_outlives_the_worker_killed_while_it_renders(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    """The worker rendering a request is killed with its pool: the job's lease runs out,
    beat sends it again, another worker renders it, and the waiting request gets its
    image, made once."""
    env = {**own_deployment, "SDQ_SERVE_WAIT_SECONDS": "300", "SDQ_LEASE_SECONDS": "6",
           "SDQ_MAINTENANCE_INTERVAL_SECONDS": "1"}  # fmt: skip
    grace = new_key(env, "grace")
    database = env["SDQ_DATABASE_URL"]
    first = WorkerProcess(env, tmp_path / "first.log", host="first").start()
    helpers = [BeatProcess(env, tmp_path / "beat.log").start(),
               WorkerProcess(env, tmp_path / "cpu.log", pool="cpu").start()]  # fmt: skip
    try:
        with (
            serving(env, tmp_path / "serve.log") as base,
            httpx.Client(base_url=base, timeout=360) as http,
            ThreadPoolExecutor(1) as client,
        ):
            slow = {"prompt": "a slow render", **TINY, "steps": 150}
            asked = client.submit(http.post, "/v1/images/generations", headers=grace, json=slow)
            wait_for(lambda: [jobs for _, jobs in runs_of(database, "grace")] == ["running"],
                     what="the request's job to run", timeout=120)  # fmt: skip
            os.killpg(first.process.pid, signal.SIGKILL)  # the worker and its pool at once
            first.process.wait()
            helpers.append(WorkerProcess(env, tmp_path / "second.log", host="second").start())
            answer = asked.result()
    finally:
        for process in helpers:
            process.stop()
    assert answer.status_code == 200, answer.text
    [(run_id, statuses)] = runs_of(database, "grace")
    assert statuses == "succeeded"
    with psycopg.connect(database) as db:
        attempts, made = db.execute(
            "SELECT j.attempts, (SELECT count(*) FROM generations g WHERE g.job_id = j.id) "
            "FROM jobs j WHERE j.run_id = %s", (run_id,),
        ).fetchone()  # fmt: skip
        workers = [row[0] for row in db.execute(
            "SELECT DISTINCT e.worker_host FROM job_events e JOIN jobs j ON j.id = e.job_id "
            "WHERE j.run_id = %s AND e.status = 'running'", (run_id,),
        )]  # fmt: skip
    assert made == 1 and attempts <= 2
    # Begun on the first machine, made on the second.
    assert sorted(host.split(":")[0] for host in workers) == ["first", "second"]


def test_a_request_goes_ahead_of_a_queued_batch_run(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    """A batch run of 20 messages is queued before the request; the worker that starts
    then takes the request at its next message (the lane, `generate.now`), not after
    the batch."""
    env = {**own_deployment, "SDQ_BATCH_SIZE": "2", "SDQ_CALLS_PER_TASK": "1"}
    prompts = tmp_path / "prompts.csv"
    prompts.write_text("prompt\n" + "".join(f"batch image {i}\n" for i in range(40)))
    batch = sdq_json(env, "submit", str(prompts), "--size", "64x64", "--steps", "2")
    eve = new_key(env, "eve")
    with (
        serving(env, tmp_path / "serve.log") as base,
        httpx.Client(base_url=base, timeout=60) as http,
    ):
        asked = http.post("/v1/jobs", headers=eve, json={"prompt": "now, please", **TINY})
        assert asked.status_code == 202, asked.text
        [job_id] = asked.json()["job_ids"]
        worker = WorkerProcess(env, tmp_path / "worker.log").start()
        try:
            wait_for(
                lambda: http.get(f"/v1/jobs/{job_id}", headers=eve).json()["status"] == "succeeded",
                what="the request's image", timeout=240,
            )  # fmt: skip
        finally:
            worker.stop()
    with psycopg.connect(env["SDQ_DATABASE_URL"]) as db:
        [before] = db.execute(
            "SELECT count(*) FROM jobs WHERE run_id = %s AND status = 'succeeded' AND "
            "finished_at < (SELECT finished_at FROM jobs WHERE id = %s)", (batch["run_id"], job_id),
        ).fetchone()  # fmt: skip
    # At most the message the worker took first, and the one it had reserved: 2 jobs each.
    assert before <= 4, f"{before} of the batch's 40 images went before the request"
    # The run says it is waited for: its retries and re-sends take the lane too.
    with psycopg.connect(env["SDQ_DATABASE_URL"]) as db:
        [options] = db.execute("SELECT task_options FROM runs WHERE id = %s",
                               (asked.json()["run_id"],)).fetchone()  # fmt: skip
    app = create_app(Settings.from_env(env))
    assert retry_queue(app, GENERATE, [job_id], options) == GENERATE.lane == "generate.now"
    assert retry_queue(app, GENERATE, [job_id], {"batch_size": 2}) == "generate"


def test_requests_that_arrive_together_share_one_pipeline_call(
    service_env: dict[str, str], worker: WorkerProcess, tmp_path: Path
) -> None:
    """Three requests of one size and steps within the window: one message, one call (the
    worker claims them at one moment and splits the call's time between them); one of
    another size goes by itself."""
    env = {**service_env, "SDQ_SERVE_BATCH_WINDOW_MS": "3000", "SDQ_BATCH_SIZE": "4"}
    frank = new_key(env, "frank")
    with (
        serving(env, tmp_path / "serve.log") as base,
        httpx.Client(base_url=base, timeout=120) as http,
    ):
        bodies = [{"prompt": f"a kite, {colour}", **TINY} for colour in ("red", "green", "blue")]
        bodies.append({"prompt": "a kite, grey", "size": "72x72", "steps": 2})
        with ThreadPoolExecutor(len(bodies)) as clients:
            answers_ = list(clients.map(
                lambda body: http.post("/v1/images/generations", headers=frank, json=body), bodies
            ))  # fmt: skip
    assert [answer.status_code for answer in answers_] == [200] * 4, answers_[0].text
    job_ids = [answer.json()["job_ids"][0] for answer in answers_]
    with psycopg.connect(env["SDQ_DATABASE_URL"]) as db:
        rendered = dict(
            (job_id, (started_at, work_seconds))
            for job_id, started_at, work_seconds in db.execute(
                "SELECT id, started_at, work_seconds FROM jobs WHERE id = ANY(%s)", (job_ids,)
            )
        )
    rendered = [rendered[job_id] for job_id in job_ids]
    together, alone = rendered[:3], rendered[3]
    assert len(set(together)) == 1, together  # one claim, one call's time split three ways
    assert alone[0] != together[0][0]


def test_a_worker_in_the_middle_of_a_batch_call_gives_way_at_its_next_step(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    """A batch message of one call of 8 images, 300 steps each: a request queued while the
    call renders stops it at its next step, not at its end; the call's jobs are put back (no
    attempt spent) and made after the request, each exactly once. A worker that does not
    take requests never gives way."""
    env = {**own_deployment, "SDQ_BATCH_SIZE": "8", "SDQ_CALLS_PER_TASK": "1"}
    prompts = tmp_path / "prompts.csv"
    database = env["SDQ_DATABASE_URL"]

    def batch_jobs(status: str) -> int:
        with psycopg.connect(database) as db:
            return db.execute("SELECT count(*) FROM jobs WHERE run_id = %s AND status = %s",
                              (batch["run_id"], status)).fetchone()[0]  # fmt: skip

    gus = new_key(env, "gus")
    # A worker of the batch queue alone sees the request waiting and never gives way: the
    # request is for other workers, and putting its batch back would only slow it.
    batch_only = WorkerProcess(env, tmp_path / "batch-worker.log", args=("--queues", "generate"))
    with serving(env, tmp_path / "serve-0.log") as base, httpx.Client(base_url=base) as http:
        first = http.post("/v1/jobs", headers=gus, json={"prompt": "for nobody here", **TINY})
        assert first.status_code == 202, first.text
    batch_only.start()
    try:
        prompts.write_text("prompt\n" + "".join(f"batch image {i}\n" for i in range(16)))
        batch = sdq_json(env, "submit", str(prompts), "--size", "64x64", "--steps", "20")
        wait_for(lambda: batch_jobs("succeeded") == 16, what="the batch beside a waiting request",
                 timeout=240)  # fmt: skip
    finally:
        batch_only.stop()
    with psycopg.connect(database) as db:
        [put_back] = db.execute(
            "SELECT count(*) FROM job_events WHERE detail LIKE 'put back%'"
        ).fetchone()
        [waiting] = db.execute(
            "SELECT status FROM jobs WHERE id = %s", first.json()["job_ids"]
        ).fetchone()
    assert (put_back, waiting) == (0, "queued")

    worker = WorkerProcess(env, tmp_path / "worker.log").start()
    try:
        with serving(env, tmp_path / "serve.log") as base, httpx.Client(base_url=base) as http:
            wait_for(lambda: http.get("/v1/jobs/" + str(first.json()["job_ids"][0]),
                                      headers=gus).json()["status"] == "succeeded",
                     what="the request left waiting", timeout=120)  # fmt: skip
            prompts.write_text("prompt\n" + "".join(f"slow image {i}\n" for i in range(8)))
            batch = sdq_json(env, "submit", str(prompts), "--size", "64x64", "--steps", "300")
            # The one call of its 8 images in hand: 300 steps to go.
            wait_for(lambda: batch_jobs("running") == 8, what="the batch call", timeout=120)
            asked = http.post("/v1/images/generations", headers=gus, timeout=300,
                              json={"prompt": "now, please", **TINY})  # fmt: skip
            assert asked.status_code == 200, asked.text
        wait_for(lambda: batch_jobs("succeeded") == 8, what="the whole batch", timeout=300)
    finally:
        worker.stop()
    [request_job] = asked.json()["job_ids"]
    with psycopg.connect(database) as db:
        [attempts, generations] = db.execute(
            "SELECT max(j.attempts), count(g.job_id) FROM jobs j JOIN generations g "
            "ON g.job_id = j.id WHERE j.run_id = %s", (batch["run_id"],),
        ).fetchone()  # fmt: skip
        put_back = db.execute(
            "SELECT j.finished_at > (SELECT finished_at FROM jobs WHERE id = %s) FROM jobs j "
            "WHERE j.run_id = %s AND EXISTS (SELECT 1 FROM job_events e WHERE e.job_id = j.id "
            "AND e.detail LIKE 'put back%%')", (request_job, batch["run_id"]),
        ).fetchall()  # fmt: skip
    # Every image of the call in hand was put back and made after the request: it did not
    # wait for the call's 300 steps.
    assert put_back == [(True,)] * 8
    assert (attempts, generations) == (1, 8)

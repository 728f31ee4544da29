"""Hostile task messages on a kind's queue: rejected, logged once, never requeued, and the
worker goes on with the next good message."""

import json
import re
import uuid

import pytest
from kombu import Connection
from sqlalchemy import select

from sdq.models.db import make_engine, session_factory
from sdq.models.jobs.kinds import KINDS
from sdq.models.tables import Job, JobEvent, JobStatus
from sdq.workers.delivery import MAX_RETRIES, JobTask
from sdq.workers.main import app
from sdq.workers.messages import CheckedTask
from tests.conftest import WorkerProcess, sdq_json, write
from tests.services import wait_for
from tests.test_jobs import new_run

# Body -> why it is refused. Each of the first two used to stop the worker for good.
BAD_BODIES = {
    "two parts": [[[1]], {}],
    "a word": "hello",
    "args not a list": [5, {}, {}],
    "job id of the wrong type": [[["x"]], {}, {}],
    "a bool for a job id": [[[True]], {}, {}],
    "no job ids": [[[]], {}, {}],
    "an option it does not take": [[[1]], {"model": "evil"}, {}],
    "an option of the wrong type": [[[1]], {"batch_size": "eight"}, {}],
    "one argument too many": [[[1], 8, 9], {}, {}],
}


# Header -> a value Celery's worker cannot use. The first used to stop the worker for good.
BAD_HEADERS = {
    "a timelimit of one word": {"timelimit": "x"},
    "a timelimit of words": {"timelimit": ["abc", 5]},
    "a negative timelimit": {"timelimit": [-5, -1]},
    "retries as a word": {"retries": "x"},
    "an eta that is no date": {"eta": "not a date"},
    "an expiry that is no date": {"expires": "garbage"},
    "no id": {"id": None},
}
# Bodies for a maintenance task, which takes no arguments; each used to stop the CPU pool.
BAD_MAINTENANCE_BODIES = [[[1], {}, {}], "hello", [[], {"now": 1}, {}], [[], {}]]
INVALID = "Received invalid task message"


def publish(broker_url: str, queue: str, task: str, body, headers: dict | None = None) -> str:
    """A message as anyone who reaches the broker can send it, the body sent as it is;
    returns its id."""
    task_id = str(uuid.uuid4())
    with Connection(broker_url) as connection:
        connection.Producer().publish(
            body if isinstance(body, bytes) else json.dumps(body),
            routing_key=queue,
            headers={"lang": "py", "task": task, "id": task_id, "root_id": task_id,
                     "parent_id": None, "retries": 0, "eta": None, "expires": None,
                     **(headers or {})},
            content_type="application/json",
            content_encoding="utf-8",
            serializer=None,
        )  # fmt: skip
    return task_id


def invalid_logged(worker: WorkerProcess) -> int:
    return worker.log.read_text().count(INVALID)


def check_went_on(worker: WorkerProcess, logged_before: int, sent: int) -> None:
    """Each bad message logged once, by the same worker that never died."""
    wait_for(lambda: invalid_logged(worker) - logged_before == sent,
             what="every bad message to be logged once", timeout=30)  # fmt: skip
    log = worker.log.read_text()
    assert "Unrecoverable error" not in log and "exited with code" not in log
    assert worker.process.poll() is None


def test_every_task_is_checked_and_every_kind_bounded() -> None:
    app.loader.import_default_modules()
    tasks = {name: task for name, task in app.tasks.items() if name.startswith("sdq.")}
    assert all(isinstance(task, CheckedTask) for task in tasks.values())
    kinds = [task for name, task in tasks.items() if not name.startswith("sdq.maintenance")]
    # Every kind's task, and the tasks named under one (train's join).
    expected = {kind.task_name for kind in KINDS.values()} | {"sdq.train.join"}
    assert {task.name for task in kinds} == expected
    assert all(isinstance(task, JobTask) and task.max_retries == MAX_RETRIES for task in kinds)


@pytest.mark.timeout(300)
def test_bad_messages_are_rejected_and_the_worker_goes_on(
    worker: WorkerProcess, service_env: dict[str, str], tmp_path
) -> None:
    broker = service_env["SDQ_BROKER_URL"]
    logged_before = invalid_logged(worker)
    sent = [publish(broker, "generate", "sdq.generate", body)
            for body in [*BAD_BODIES.values(), b"[[1], {}, {"]]  # fmt: skip
    for headers in BAD_HEADERS.values():
        publish(broker, "generate", "sdq.generate", [[999_999_999], {}, {}], headers)
    # A gang's call to join names one job, never two.
    sent.append(publish(broker, "train", "sdq.train.join", [[[1, 2], 1], {}, {}]))

    # The same worker, still alive, renders the next good job.
    prompts = write(tmp_path / "p.csv", "prompt,seed\nafter the hostile messages,3\n")
    run = sdq_json(service_env, "submit", str(prompts), "--steps", "2", "--wait")
    assert run["counts"] == {"succeeded": 1}
    check_went_on(worker, logged_before, len(BAD_BODIES) + 2 + len(BAD_HEADERS))
    log = worker.log.read_text()
    assert all(f"(message '{message_id}')" in log for message_id in sent)
    with Connection(broker) as connection:
        # Rejected, not requeued: nothing waits on the queue.
        assert connection.default_channel.queue_declare("generate").message_count == 0


@pytest.mark.timeout(300)
def test_bad_messages_on_the_maintenance_queue_leave_the_cpu_pool_working(
    own_deployment: dict[str, str], tmp_path
) -> None:
    # A broker of its own: no message another test left on the CPU queues goes before the tick.
    cpu_worker = WorkerProcess(own_deployment, tmp_path / "cpu.log", pool="cpu").start()
    try:
        send_bad_ticks_then_a_good_one(cpu_worker, own_deployment["SDQ_BROKER_URL"])
    finally:
        cpu_worker.stop()


def send_bad_ticks_then_a_good_one(cpu_worker: WorkerProcess, broker: str) -> None:
    relay = "sdq.maintenance.relay"
    for body in BAD_MAINTENANCE_BODIES:
        publish(broker, "maintenance", relay, body)
    for headers in BAD_HEADERS.values():
        publish(broker, "maintenance", relay, [[], {}, {}], headers)
    publish(broker, "maintenance", relay, [[], {}, {}])  # a good one after them
    ran = re.compile(rf"Task {re.escape(relay)}\[[-0-9a-f]+\] succeeded")
    wait_for(lambda: ran.search(cpu_worker.log.read_text()), what="the good tick", timeout=60)
    check_went_on(cpu_worker, 0, len(BAD_MAINTENANCE_BODIES) + len(BAD_HEADERS))


@pytest.mark.timeout(120)
def test_a_message_naming_another_kind_s_job_leaves_that_job_alone(
    worker: WorkerProcess, service_env: dict[str, str]
) -> None:
    """A train message naming a queued generation job: the train task claims only train
    jobs, so the generation job keeps its status, its attempts and its history, and the
    worker says what it left alone."""
    sessions = session_factory(make_engine(service_env["SDQ_DATABASE_URL"]))
    spec = {"prompt": f"not a train job {uuid.uuid4()}"}
    [job_id] = new_run(sessions, spec, status=JobStatus.queued)
    publish(service_env["SDQ_BROKER_URL"], "train", "sdq.train", [[[job_id]], {}, {}])
    said = f"a train message names jobs of other kinds, left alone: {job_id} (generate)"
    wait_for(lambda: said in worker.log.read_text(), what="the message to be turned away",
             timeout=60)  # fmt: skip
    with sessions() as session:
        job = session.get(Job, job_id)
        events = session.scalars(select(JobEvent.status).where(JobEvent.job_id == job_id)).all()
    assert (job.status, job.attempts, job.worker_host, events) == (JobStatus.queued, 0, None, [])
    with sessions.begin() as session:  # no relay of the session's deployment ever sends it
        session.get(Job, job_id).status = JobStatus.cancelled

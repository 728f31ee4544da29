"""Hostile task messages on a kind's queue: rejected, logged once, never requeued, and the
worker goes on with the next good message."""

import json
import uuid

import pytest
from kombu import Connection

from sdq.workers.delivery import MAX_RETRIES, JobTask
from sdq.workers.main import app
from tests.conftest import WorkerProcess, sdq_json, write
from tests.services import wait_for

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


def publish(broker_url: str, task: str, body) -> str:
    task_id = str(uuid.uuid4())
    with Connection(broker_url) as connection:
        connection.Producer().publish(
            json.dumps(body),
            routing_key="generate",
            headers={"lang": "py", "task": task, "id": task_id, "root_id": task_id,
                     "parent_id": None, "retries": 0, "eta": None, "expires": None},
            content_type="application/json",
            content_encoding="utf-8",
            serializer=None,
        )  # fmt: skip
    return task_id


def test_every_task_of_a_kind_is_checked_and_bounded() -> None:
    app.loader.import_default_modules()
    tasks = [task for name, task in app.tasks.items() if name.startswith("sdq.") and
             not name.startswith("sdq.maintenance")]  # fmt: skip
    assert {task.name for task in tasks} == {"sdq.generate", "sdq.download", "sdq.encode",
                                             "sdq.train", "sdq.train.join"}  # fmt: skip
    assert all(isinstance(task, JobTask) and task.max_retries == MAX_RETRIES for task in tasks)


@pytest.mark.timeout(300)
def test_bad_messages_are_rejected_and_the_worker_goes_on(
    worker: WorkerProcess, service_env: dict[str, str], tmp_path
) -> None:
    broker = service_env["SDQ_BROKER_URL"]
    logged_before = worker.log.read_text().count("Received invalid task message")
    for body in BAD_BODIES.values():
        publish(broker, "sdq.generate", body)

    # The same worker, still alive, renders the next good job.
    prompts = write(tmp_path / "p.csv", "prompt,seed\nafter the hostile messages,3\n")
    run = sdq_json(service_env, "submit", str(prompts), "--steps", "2", "--wait")
    assert run["counts"] == {"succeeded": 1}
    assert worker.process.poll() is None

    def all_logged() -> bool:
        logged = worker.log.read_text().count("Received invalid task message")
        return logged - logged_before == len(BAD_BODIES)

    wait_for(all_logged, what="every bad message to be logged once", timeout=30)
    with Connection(broker) as connection:
        # Rejected, not requeued: nothing waits on the queue.
        assert connection.default_channel.queue_declare("generate").message_count == 0

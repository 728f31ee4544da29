"""Warming up at start and routing to the warm: two worker processes (each with a host
name of its own) that compile the tiny model at different shapes before they take a job,
and a run of both shapes whose jobs each go to their warm worker, none waiting for a load;
a warm worker that dies is passed by."""

import os
import signal
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import select

from sdq.models.db import make_engine, session_factory
from sdq.models.jobs.kinds import WARM
from sdq.models.settings import Settings
from sdq.models.tables import Job
from sdq.workers.app import create_app
from sdq.workers.maintenance import idle_queues
from sdq.workers.routing import live_warm_queues
from tests.conftest import WorkerProcess, sdq_json, wait_for_run, write
from tests.services import wait_for

pytestmark = pytest.mark.slow


class Warm(WorkerProcess):
    """`sdq worker gpu --queues generate` warming the tiny model up at SDQ_WARM_SHAPES=`shape`,
    on a host of its own name: its node is cpu-render@NAME, its jobs NAME:pid."""

    def __init__(self, env: dict[str, str], name: str, shape: str, log: Path) -> None:
        warming = {**env, "SDQ_WARM_SHAPES": shape, "SDQ_WARM_MODELS": "tiny"}
        super().__init__(warming, log, args=("--queues", "generate"), host=name)
        self.node = f"cpu-render@{name}"
        self.start()

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def test_each_shape_s_jobs_go_to_the_worker_that_has_it_warm(own_deployment, tmp_path) -> None:
    env = {**own_deployment, "SDQ_COMPILE": "1", "SDQ_COMPILE_BACKEND": "eager",
           "SDQ_COMPILE_BATCHES": "1,2", "SDQ_CALLS_PER_TASK": "1",
           "SDQ_WARM_SHAPES": "64x64,96x64"}  # fmt: skip
    app = create_app(Settings.from_env(env))
    sessions = session_factory(make_engine(env["SDQ_DATABASE_URL"]))

    def consumed(node: str) -> set[str]:
        answered = app.control.inspect(timeout=1).active_queues() or {}
        return {queue["name"] for queue in answered.get(node, [])}

    def run(name: str, shapes: list[str]) -> dict[str, set[str]]:
        """Submits a job per shape, in order; the hosts that did each shape's jobs."""
        rows = "".join(f"{name} {n},{n},{shape.replace('x', ',')}\n"
                       for n, shape in enumerate(shapes))  # fmt: skip
        listing = write(tmp_path / f"{name}.csv", "prompt,seed,width,height\n" + rows)
        submitted = sdq_json(env, "submit", str(listing), "--steps", "1", "--batch-size", "1")
        done = wait_for_run(env["SDQ_DATABASE_URL"], submitted["run_id"])
        assert done == {"succeeded": len(shapes)}
        with sessions() as session:
            jobs = session.execute(select(Job.spec, Job.worker_host, Job.setup_seconds)
                                   .where(Job.run_id == submitted["run_id"])).all()  # fmt: skip
        # Warmed up before they took a job: no job waited for its pipeline to load.
        assert [setup for _, _, setup in jobs] == [None] * len(shapes)
        hosts: dict[str, set[str]] = {}
        for spec, host, _ in jobs:
            hosts.setdefault(f"{spec['width']}x{spec['height']}", set()).add(host.split(":")[0])
        return hosts

    def takes_jobs(worker: Warm, shape: str) -> bool:
        """It consumes `generate` and its shape's warm queue: it has warmed up. (A worker
        that died fails the test at once.)"""
        worker.ready()
        queues = consumed(worker.node)
        return "generate" in queues and any(WARM in q and q.endswith(shape) for q in queues)

    first = Warm(env, "warma", "64x64", tmp_path / "a.log")
    second = Warm(env, "warmb", "96x64", tmp_path / "b.log")
    try:
        for worker, shape in ((first, "64x64"), (second, "96x64")):
            # Two workers compile at once beside the rest of the suite: on two loaded cores
            # that took over 90 s. The wait is a net for a worker that hangs, not a measure.
            wait_for(partial(takes_jobs, worker, shape), what=f"{worker.node} warm", timeout=300)
            assert "warm: model tiny loaded and compiled" in worker.log.read_text()

        # Both consume `generate`; each shape's jobs go to the worker that has it warm.
        assert run("both", ["64x64", "96x64"] * 6) == {"64x64": {"warma"}, "96x64": {"warmb"}}
        # Beat's relay sees the warm queues, empty now, beside `generate`.
        warm = live_warm_queues(app.settings, app.control)
        assert len(warm) == 2 and warm <= set(app.queue_depths(warm))
        assert "generate" in idle_queues(app)

        # A warm worker that dies has no queue any more: its shape's jobs go to `generate`,
        # where the other worker compiles the shape (its batch sizes are warm) as it loads
        # nothing new.
        second.kill()
        wait_for(lambda: not consumed(second.node), what="warmb gone", timeout=30)
        assert run("fallback", ["96x64", "96x64"]) == {"96x64": {"warma"}}
    finally:
        for worker in (first, second):
            worker.kill()


def test_a_retry_goes_where_a_live_worker_will_take_it(own_deployment, tmp_path) -> None:
    """A retry is routed as a new message is, not to the queue its message came in on: to
    the warm queue while a live worker consumes it, else to the kind's queue, where any
    worker takes it (a retry sent to a warm queue nobody consumes any more waited for ever)."""
    from sdq.models.jobs.kinds import GENERATE
    from sdq.workers.delivery import retry_queue

    env = {**own_deployment, "SDQ_COMPILE": "1", "SDQ_COMPILE_BACKEND": "eager",
           "SDQ_COMPILE_BATCHES": "1", "SDQ_WARM_SHAPES": "64x64"}  # fmt: skip
    app = create_app(Settings.from_env(env))
    listing = write(tmp_path / "retried.csv", "prompt,seed,width,height\nretried,1,64,64\n")
    run_id = sdq_json(env, "submit", str(listing), "--model", "tiny", "--steps", "1")["run_id"]
    with session_factory(make_engine(env["SDQ_DATABASE_URL"]))() as session:
        job_ids = list(session.scalars(select(Job.id).where(Job.run_id == run_id)))
    assert retry_queue(app, GENERATE, job_ids) == "generate"  # nobody has it warm
    worker = Warm(env, "warm-a", "64x64", tmp_path / "a.log")
    try:
        wait_for(lambda: worker.ready() and retry_queue(app, GENERATE, job_ids).startswith(
            f"generate{WARM}"), what="the warm worker's queue", timeout=300)  # fmt: skip
        warm = retry_queue(app, GENERATE, job_ids)
        # Its task done (after each, a worker's warm queues follow what it holds), the
        # worker stops consuming the queue, as one that let its pipeline go does.
        assert wait_for_run(env["SDQ_DATABASE_URL"], run_id) == {"succeeded": 1}
        # Celery answers a cancel before it acts on it (the worker's next loop does): the
        # worker is asked until it has stopped.
        app.control.cancel_consumer(warm, destination=[worker.node], reply=True)

        def let_go() -> bool:
            """The worker answers, and consumes the queue no more."""
            answered = app.control.inspect(destination=[worker.node], timeout=1).active_queues()
            queues = (answered or {}).get(worker.node)
            return queues is not None and warm not in {queue["name"] for queue in queues}

        wait_for(let_go, what="the warm queue let go of", timeout=30)
        assert retry_queue(app, GENERATE, job_ids) == "generate"  # let go of: the kind's
    finally:
        worker.kill()

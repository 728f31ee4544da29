"""Prometheus metrics Flower does not have, read from the broker and the database at each
scrape: queue depths, jobs by kind and status, outputs and images or samples per second,
what each worker holds (jobs, memory, GPU memory), lease expiries, retries and dead jobs,
workers out of rotation; and what each kind adds (its ProducerHooks.metrics)."""

from collections.abc import Iterator
from datetime import datetime, timedelta

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import ColumnElement, Select, func, select

from sdq.models.jobs.kinds import KINDS
from sdq.models.jobs.lifecycle import utcnow
from sdq.models.jobs.maintenance import EXPIRED
from sdq.models.tables import Job, JobEvent, JobStatus, SickWorker
from sdq.workers.app import SdqCelery
from sdq.workers.memory import DEVICE_MEMORY_COMMAND

# Outputs per second are counted over this window.
RATE_WINDOW = timedelta(minutes=5)
# How long a scrape waits for workers to say what memory they hold.
REPLY_SECONDS = 1.0
GPU_READINGS = {
    "utilization_percent": "Share of the last sample period a kernel ran on the GPU",
    "temperature_celsius": "GPU core temperature",
    "power_watts": "GPU power draw",
}
# Counters of setbacks, each by the events that record it: name, help, which events.
SETBACK_COUNTERS = {
    "sdq_lease_expiries": (
        "Running jobs whose lease ran out",
        (JobEvent.status == JobStatus.pending) & (JobEvent.detail == EXPIRED),
    ),
    "sdq_retries": ("Failures that were retried", JobEvent.status == JobStatus.failed),
    "sdq_dead_jobs": ("Jobs that gave up", JobEvent.status == JobStatus.dead),
}


def _card_families() -> dict[str, GaugeMetricFamily]:
    """The GPU families, by the key of a worker's answer that each reports."""
    labels = ["worker", "gpu", "name"]
    return {
        "used_by_worker_bytes": GaugeMetricFamily(
            "sdq_worker_gpu_memory_bytes",
            "GPU memory a worker's processes hold, per GPU it serves",
            labels=labels,
        ),
        "used_bytes": GaugeMetricFamily(
            "sdq_gpu_memory_used_bytes",
            "GPU memory in use on the device, by anyone, per GPU a worker serves",
            labels=labels,
        ),
        "total_bytes": GaugeMetricFamily(
            "sdq_gpu_memory_total_bytes", "GPU memory in all", labels=labels
        ),
        **{
            key: GaugeMetricFamily(f"sdq_gpu_{key}", text, labels=labels)
            for key, text in GPU_READINGS.items()
        },
    }


class SdqCollector:
    """A prometheus_client collector: everything is asked afresh at each scrape."""

    def __init__(self, app: SdqCelery) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "sdq_queue_messages", "Messages waiting in the broker, per queue", labels=["queue"]
        )
        for queue, messages in self.app.queue_depths().items():
            depth.add_metric([queue], messages)
        yield depth
        yield from self._memory()
        with self.app.sessions() as session:
            yield from self._jobs(session)
            yield self._sick(session)
            for kind in KINDS.values():
                if (kind_metrics := kind.producer_hooks().metrics) is not None:
                    yield from kind_metrics(session, self.app)

    def _memory(self) -> Iterator[Metric]:
        """Each live worker's memory, as it answers the device_memory control command: the
        worker's own, then each GPU's as the worker and as NVML see it, and the device's own
        readings where NVML has them. Every live worker is asked at once; one that does not
        answer in time is left out."""
        resident = GaugeMetricFamily(
            "sdq_worker_memory_bytes",
            "Resident memory of a worker's processes (main and pool)",
            labels=["worker"],
        )
        cards = _card_families()
        replies = self.app.control.broadcast(
            DEVICE_MEMORY_COMMAND, reply=True, timeout=REPLY_SECONDS
        )
        for reply in replies:
            for worker, answer in reply.items():
                if "rss_bytes" not in answer:  # a worker that does not know the command
                    continue
                resident.add_metric([worker], answer["rss_bytes"])
                for card in answer["gpus"]:
                    for key, family in cards.items():
                        if card.get(key) is not None:
                            family.add_metric([worker, card["gpu"], card["name"]], card[key])
        yield from (resident, *cards.values())

    def _sick(self, session) -> Metric:
        sick = GaugeMetricFamily(
            "sdq_worker_sick",
            "1 for a worker out of rotation: its device failed task after task",
            labels=["worker"],
        )
        for worker in session.scalars(select(SickWorker.worker)):
            sick.add_metric([worker], 1)
        return sick

    def _jobs(self, session) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("sdq_jobs", "Jobs by kind and status", labels=["kind", "status"])
        for kind, status, count in session.execute(jobs_by_kind_and_status()):
            jobs.add_metric([kind, str(status)], count)
        yield jobs

        rate = GaugeMetricFamily(
            "sdq_outputs_per_second",
            f"Outputs made (not served from cache) per second over {RATE_WINDOW}",
            labels=["kind"],
        )
        made = GaugeMetricFamily(
            "sdq_units_per_second",
            f"What each kind makes (images, samples) per second over {RATE_WINDOW}",
            labels=["kind"],
        )
        since = utcnow() - RATE_WINDOW
        window = RATE_WINDOW.total_seconds()
        for kind, count, units in session.execute(made_since(since)):
            rate.add_metric([kind], count / window)
            made.add_metric([kind], (units or 0) / window)
        yield from (rate, made)

        yield self._held(session, since)

        yield from self._events(session)

    def _held(self, session, since: datetime) -> Metric:
        """Jobs each worker holds now; 0 for a worker that finished jobs within the rate
        window and holds none (an idle worker is a sample, not a gap on the dashboard)."""
        held = GaugeMetricFamily(
            "sdq_worker_running_jobs", "Jobs each worker holds now", labels=["worker", "device"]
        )
        running = select(Job.worker_host, Job.device, func.count()).where(
            Job.status == JobStatus.running
        )
        counts = dict.fromkeys(
            session.execute(
                select(Job.worker_host, Job.device)
                .where(Job.finished_at >= since, Job.worker_host.is_not(None))
                .distinct()
            ).all(),
            0,
        )
        for worker, device, count in session.execute(running.group_by(Job.worker_host, Job.device)):
            counts[(worker, device)] = count
        for (worker, device), count in counts.items():
            held.add_metric([worker or "", device or ""], count)
        return held

    def _events(self, session) -> Iterator[Metric]:
        for name, (text, which) in SETBACK_COUNTERS.items():
            family = CounterMetricFamily(name, text, labels=["kind"])
            # Every kind from 0: a counter that appears only once it is 1 cannot be
            # alerted on by its rate, and a dashboard shows "no data" for "none".
            counts = dict.fromkeys(KINDS, 0) | dict(session.execute(events_by_kind(which)).all())
            for kind, count in counts.items():
                family.add_metric([kind], count)
            yield family


def jobs_by_kind_and_status() -> Select[tuple[str, JobStatus, int]]:
    """Jobs counted by kind and status: on Postgres from ix_jobs_run_id_status alone, which
    carries the kind, so a scrape does not read every job."""
    return select(Job.kind, Job.status, func.count()).group_by(Job.kind, Job.status)


def made_since(since: datetime) -> Select[tuple[str, int, int | None]]:
    """Outputs made (not served from the cache) since `since` by kind, and their units:
    from the finished jobs' index."""
    return (
        select(Job.kind, func.count(), func.sum(Job.units))
        .where(Job.status == JobStatus.succeeded, ~Job.cached, Job.finished_at >= since)
        .group_by(Job.kind)
    )


def events_by_kind(which: ColumnElement[bool]) -> Select[tuple[str, int]]:
    """Setback events of one sort by their job's kind: on Postgres read from the setbacks'
    own small index, not from among every event."""
    return (
        select(Job.kind, func.count())
        .join(JobEvent, JobEvent.job_id == Job.id)
        .where(which)
        .group_by(Job.kind)
    )

"""Is the deployment whole? Each part is asked directly: the database (and its schema), the
broker, the object store (a probe written, read and deleted), the workers behind each queue
(a Celery ping), workers out of rotation for a failing device, and beat (its tasks' last
tick)."""

import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import func, make_url, select

from sdq.migrations import ready
from sdq.models.jobs.kinds import QUEUES
from sdq.models.jobs.lifecycle import as_utc, utcnow
from sdq.models.tables import MaintenanceTick, SickWorker
from sdq.workers.app import SdqCelery

PROBE = b"sdq health probe"
# Seconds a ping or an inspect waits for workers to answer.
REPLY_SECONDS = 2.0
# Beat is late once its last tick is this many intervals old.
LATE_INTERVALS = 3


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def health(app: SdqCelery) -> list[Check]:
    database = _run("database", lambda: _database(app))
    checks = [database, _run("store", lambda: _store(app))]
    if app.settings.embedded:
        return [*checks, Check("broker", True, "none: embedded, work runs in the command")]
    broker = _run("broker", lambda: _broker(app))
    if broker.ok:
        workers = _workers(app)
    else:
        workers = [Check(f"workers: {queue}", False, "not asked: no broker") for queue in QUEUES]
    # What the database records is not asked of one that is down or has no schema yet: its
    # own row says what to do, and the tables' errors would only repeat it.
    recorded = {"devices": _devices, "beat": _beat}
    if database.ok:
        read = [_run(name, lambda check=check: check(app)) for name, check in recorded.items()]
    else:
        read = [Check(name, False, "not asked: the database is not ready") for name in recorded]
    return [*checks, broker, *workers, *read]


def as_json(checks: list[Check]) -> dict[str, Any]:
    return {"ok": all(check.ok for check in checks), "checks": [asdict(c) for c in checks]}


def _run(name: str, probe: Callable[[], str]) -> Check:
    """A probe returns what it found, or raises what is wrong."""
    try:
        return Check(name, True, probe())
    except Exception as error:  # any failure of the part is the answer, not a crash
        return Check(name, False, f"{type(error).__name__}: {error}".splitlines()[0])


def _database(app: SdqCelery) -> str:
    if not ready(app.engine):
        raise RuntimeError("the schema is not current: run `sdq db upgrade`")
    # The URL as set (the password masked), not the engine's: a read-only SQLite engine's
    # is rewritten into a file: URI the user never wrote.
    return f"{make_url(app.settings.database_url).render_as_string()} (schema current)"


def _store(app: SdqCelery) -> str:
    key = f"health/probe-{uuid.uuid4().hex}"
    app.store.put_bytes(key, PROBE, content_type="text/plain")
    try:
        if app.store.get_bytes(key) != PROBE:
            raise RuntimeError(f"{app.store.uri(key)} read back different bytes")
    finally:
        app.store.delete(key)
    return f"{app.store.uri('')} (wrote, read and deleted a probe)"


def _broker(app: SdqCelery) -> str:
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=1)
        return connection.as_uri()


def consumed_queues(app: SdqCelery) -> set[str]:
    """The queues live workers consume now, as they answer a ping."""
    return {queue["name"] for queues in _active_queues(app).values() for queue in queues}


def _active_queues(app: SdqCelery) -> dict[str, list[dict]]:
    """Each live worker's queues, by its name, as it answers a ping."""
    return app.control.inspect(timeout=REPLY_SECONDS).active_queues() or {}


def _workers(app: SdqCelery) -> list[Check]:
    """One check per queue: the workers that consume it and answered a ping."""
    answered = _active_queues(app)
    consumers = {
        queue: sorted(worker for worker, queues in answered.items()
                      if any(q["name"] == queue for q in queues))
        for queue in QUEUES
    }  # fmt: skip
    return [
        Check(f"workers: {queue}", bool(names), ", ".join(names) or "no worker answered")
        for queue, names in consumers.items()
    ]


def _devices(app: SdqCelery) -> str:
    """Workers taken out of rotation for a failing device (workers/sickness.py)."""
    with app.sessions() as session:
        sick = session.scalars(select(SickWorker).order_by(SickWorker.worker)).all()
    if sick:
        raise RuntimeError(
            "; ".join(f"{worker.worker} out of rotation: {worker.reason}" for worker in sick)
            + " (`sdq worker clear NAME` puts one back)"
        )
    return "no worker out of rotation"


def _beat(app: SdqCelery) -> str:
    with app.sessions() as session:
        last = session.scalar(select(func.max(MaintenanceTick.at)))
    if last is None:
        raise RuntimeError("beat has never ticked: is `sdq beat` running?")
    age = utcnow() - as_utc(last)
    late = timedelta(seconds=LATE_INTERVALS * app.settings.maintenance.interval_seconds)
    if age > late:
        raise RuntimeError(f"last tick {age.total_seconds():.0f} s ago: is `sdq beat` running?")
    return f"last tick {age.total_seconds():.0f} s ago"

"""Word of jobs over Redis pub/sub: what `sdq serve` waits on instead of polling the
database. A worker publishes on a job's channel when it claims the job; a job's settling
(done, dead or cancelled, whoever settled it: a worker's delivery, a lost job out of
attempts, `sdq cancel`) is published once the transaction that settled it commits.
Nothing is kept: a listener subscribes first, then reads the job's row, and so misses
nothing that happens after its read."""

import logging
from collections.abc import Iterable
from functools import cache

import redis
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.settings import Settings

logger = logging.getLogger(__name__)


def notices_url(settings: Settings) -> str | None:
    """The Redis the notices travel on: the broker's, where it is Redis."""
    url = settings.broker_url
    return url if url and url.startswith(("redis://", "rediss://")) else None


def channel(job_id: int) -> str:
    return f"sdq:job:{job_id}"


@cache
def broker_redis(url: str) -> redis.Redis:
    """This process's client of the broker's Redis (notices, and what a worker asks of
    its queues)."""
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def publish(url: str, job_ids: Iterable[int], what: str) -> None:
    """One notice per job (`running`, `settled`), in one round trip. A Redis that fails here
    costs a waiting request only its answer's speed: it reads the job's row at its
    deadline."""
    job_ids = list(job_ids)
    try:
        with broker_redis(url).pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.publish(channel(job_id), what.encode())
            pipe.execute()
    except redis.RedisError:
        logger.exception("jobs %s: the notice that they are %s was not sent", job_ids, what)


# Where a session keeps the jobs it settled until its transaction ends.
NOTED = "sdq.settled"


def note_settled(session: Session, job_ids: Iterable[int]) -> None:
    """Jobs this session's transaction settles: told of once it commits (tell_settled)."""
    session.info.setdefault(NOTED, []).extend(job_ids)


def tell_settled(sessions: sessionmaker[Session], url: str | None) -> sessionmaker[Session]:
    """Sessions that publish the jobs they settled once their outermost transaction commits
    (a listener reading the row on the notice finds it settled; a savepoint's release is not
    a commit), and forget them when it ends otherwise."""
    if url is not None:

        def told(session: Session) -> None:
            if session.in_nested_transaction():  # a savepoint released: not a commit
                return
            if settled := session.info.pop(NOTED, None):
                try:
                    publish(url, settled, "settled")
                except Exception:  # committed all the same: never fail the caller here
                    logger.exception("jobs %s: the notice that they settled was not sent", settled)

        def ended(session: Session, transaction) -> None:
            if transaction.parent is None:  # rolled back, or closed without a commit
                session.info.pop(NOTED, None)

        event.listen(sessions, "after_commit", told)
        event.listen(sessions, "after_transaction_end", ended)
    return sessions

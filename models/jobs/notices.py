"""Word of jobs over Redis pub/sub: what `sdq serve` waits on instead of polling the
database. A worker publishes on a job's channel when it claims the job and when it settles
it (done, served from the store, or dead). Nothing is kept: a listener subscribes first,
then reads the job's row, and so misses nothing that happens after its read."""

import logging
from collections.abc import Iterable
from functools import cache

import redis

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

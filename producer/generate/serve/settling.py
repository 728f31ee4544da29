"""Waiting for jobs: subscribed to their notices (models/jobs/notices.py) before
their rows are read, so nothing that settles after the read is missed, and no database is
polled while a request waits."""

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager

from redis.asyncio import Redis

from sdq.models.jobs.notices import channel


class Settling:
    """Notices of some jobs, heard from the moment it is entered."""

    def __init__(self, pubsub) -> None:
        self._pubsub = pubsub

    async def until(
        self,
        unsettled: Callable[[], Awaitable[Collection[int]]],
        deadline: float,
    ) -> set[int]:
        """Waits until none of the jobs is unsettled (as their rows say: read once now,
        then again as their notices come) or the deadline (a time.monotonic()); returns
        those still unsettled."""
        waiting = set(await unsettled())
        while waiting and (left := deadline - time.monotonic()) > 0:
            heard = await self.notice(left)
            if heard is not None and heard[0] in waiting and heard[1] == "settled":
                waiting = set(await unsettled())
        return waiting

    async def notice(self, timeout: float) -> tuple[int, str] | None:
        """The next notice (the job, and what it says: `running`, `settled`), or None when
        none comes in time."""
        message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
        if message is None:
            return None
        return int(message["channel"].rpartition(b":")[2]), message["data"].decode()


@asynccontextmanager
async def settling(redis: Redis, job_ids: Collection[int]) -> AsyncIterator[Settling]:
    pubsub = redis.pubsub()
    try:
        await pubsub.subscribe(*(channel(job_id) for job_id in job_ids))
        yield Settling(pubsub)
    finally:
        await asyncio.shield(pubsub.aclose())

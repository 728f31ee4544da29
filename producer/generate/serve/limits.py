"""Each API key's share, counted in Redis so that every `sdq serve` process counts the same:
requests a minute (a window per clock minute) and images in flight (a sorted set of job
ids, each scored with when it stops counting should nobody hear it settle)."""

import time
from dataclasses import dataclass

from redis.asyncio import Redis


class Exceeded(Exception):
    """Past a limit: 429, to be tried again after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.message, self.retry_after = message, retry_after


@dataclass(frozen=True)
class Limits:
    redis: Redis
    per_minute: int
    in_flight: int

    async def take_request(self, key_name: str) -> None:
        now = time.time()
        minute = int(now // 60)
        counter = f"sdq:serve:requests:{key_name}:{minute}"
        async with self.redis.pipeline(transaction=True) as pipe:
            made, _ = await pipe.incr(counter).expire(counter, 120).execute()
        if made > self.per_minute:
            raise Exceeded(
                f"key {key_name!r}: more than {self.per_minute} requests a minute "
                "(SDQ_SERVE_REQUESTS_PER_MINUTE)",
                retry_after=max(1, 60 - int(now % 60)),
            )

    async def check_room(self, key_name: str, images: int) -> None:
        """Refuses `images` more where the key's images in flight would pass the cap."""
        flying = _flight(key_name)
        async with self.redis.pipeline(transaction=True) as pipe:
            _, count = (
                await pipe.zremrangebyscore(flying, "-inf", time.time()).zcard(flying).execute()
            )
        if count + images > self.in_flight:
            raise Exceeded(
                f"key {key_name!r}: {count} images in flight, {images} more would pass "
                f"{self.in_flight} (SDQ_SERVE_IMAGES_IN_FLIGHT)",
                retry_after=1,
            )

    async def fly(self, key_name: str, job_ids: list[int], until: float) -> None:
        if job_ids:
            await self.redis.zadd(_flight(key_name), {str(job_id): until for job_id in job_ids})

    async def land(self, key_name: str, job_ids: list[int]) -> None:
        if job_ids:
            await self.redis.zrem(_flight(key_name), *map(str, job_ids))


def _flight(key_name: str) -> str:
    return f"sdq:serve:in-flight:{key_name}"

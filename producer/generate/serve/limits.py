"""Each API key's share, counted in Redis so that every `sdq serve` process counts the same:
requests a minute (a window per clock minute) and images in flight (a sorted set of a
token per image, each scored with when it stops counting should nobody hear it land)."""

import time
import uuid
from dataclasses import dataclass

from redis.asyncio import Redis

from sdq.producer.generate.serve.requests import Refusal


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

    async def reserve(self, key_name: str, images: int, until: float) -> list[str]:
        """Room for `images` more in flight, taken at once (one script: requests that
        come together cannot all pass the cap); the tokens to release as they land."""
        if images > self.in_flight:  # no wait would let it through
            cap = f"at most {self.in_flight} images in flight a key (SDQ_SERVE_IMAGES_IN_FLIGHT)"
            raise Refusal("n", f"{cap}: this request could never pass")
        tokens = [uuid.uuid4().hex for _ in range(images)]
        held = await self.redis.eval(
            RESERVE, 1, _flight(key_name), time.time(), self.in_flight, until, *tokens
        )
        if held >= 0:
            raise Exceeded(
                f"key {key_name!r}: {held} images in flight, {images} more would pass "
                f"{self.in_flight} (SDQ_SERVE_IMAGES_IN_FLIGHT)",
                retry_after=1,
            )
        return tokens

    async def release(self, key_name: str, tokens: list[str]) -> None:
        if tokens:
            await self.redis.zrem(_flight(key_name), *tokens)


# Drops what has expired, then takes room for ARGV[4..] if it fits under ARGV[2], each
# expiring at ARGV[3]; returns -1 when taken, else how many are in flight.
RESERVE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local held = redis.call('ZCARD', KEYS[1])
if held + #ARGV - 3 > tonumber(ARGV[2]) then
    return held
end
for i = 4, #ARGV do
    redis.call('ZADD', KEYS[1], ARGV[3], ARGV[i])
end
return -1
"""


def _flight(key_name: str) -> str:
    return f"sdq:serve:in-flight:{key_name}"

"""The API's figures, kept in the broker's Redis so that `sdq metrics` shows every replica's
together: each request's latency by route and status (a histogram, its buckets counters of
a hash), and the requests in flight (a sorted set of a token per request, scored with when
it stops counting should its replica die before it answers).

A request is answered when its response starts: an event stream's latency is the time to
its first event, and it stops counting in flight then, however long it stays open. A Redis
that fails here costs the figures, never the request."""

import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import redis
from redis.asyncio import Redis
from sqlalchemy.orm import Session

from sdq.models.jobs.notices import broker_redis, notices_url

if TYPE_CHECKING:  # the serve extra's: `sdq metrics` reads the figures without it
    from fastapi import FastAPI, Request

    from sdq.workers.app import SdqCelery

logger = logging.getLogger(__name__)

LATENCY = "sdq:serve:latency"
IN_FLIGHT = "sdq:serve:in_flight"
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
# A hash field: route, status and "le=<bucket>", "sum" or "count", apart by tabs.
SEPARATOR = "\t"


def add_figures(api: "FastAPI", client: Redis, flight_seconds: float) -> None:
    """Every request counted in flight until it is answered (at most `flight_seconds`),
    then its latency recorded by route and status."""

    async def figured(request: "Request", call_next):
        started = time.perf_counter()
        token = await _started(client, until=time.time() + flight_seconds)
        status = 500  # what the server answers a request whose handler raised
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            route = request.scope.get("route")
            await _answered(client, token, route.path if route else "unknown", status,
                            time.perf_counter() - started)  # fmt: skip

    api.middleware("http")(figured)


async def _started(client: Redis, until: float) -> str | None:
    token = uuid.uuid4().hex
    try:
        await client.zadd(IN_FLIGHT, {token: until})
    except redis.RedisError:
        logger.warning("a request's figures were not recorded: Redis did not answer")
        return None
    return token


async def _answered(
    client: Redis, token: str | None, route: str, status: int, seconds: float
) -> None:
    prefix = f"{route}{SEPARATOR}{status}{SEPARATOR}"
    try:
        async with client.pipeline(transaction=False) as pipe:
            if token is not None:
                pipe.zrem(IN_FLIGHT, token)
            for bucket in BUCKETS:
                if seconds <= bucket:
                    pipe.hincrby(LATENCY, f"{prefix}le={bucket}", 1)
            pipe.hincrbyfloat(LATENCY, f"{prefix}sum", seconds)
            pipe.hincrby(LATENCY, f"{prefix}count", 1)
            await pipe.execute()
    except redis.RedisError:
        logger.warning("a request's figures were not recorded: Redis did not answer")


def serve_metrics(_session: Session, app: "SdqCelery") -> Iterator[Any]:
    """`sdq metrics`' families of every replica's requests: the latency histogram by route
    and status, and the requests in flight (a dead replica's stop counting at their time).
    None without a Redis broker, where `sdq serve` does not run."""
    from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

    if (url := notices_url(app.settings)) is None:
        return
    client = broker_redis(url)
    latency = HistogramMetricFamily(
        "sdq_serve_request_seconds",
        "Time from a request to `sdq serve` to its answer, by route and status",
        labels=["route", "status"],
    )
    for (route, status), figures in _latencies(client).items():
        buckets = [(str(bucket), figures.get(f"le={bucket}", 0)) for bucket in BUCKETS]
        latency.add_metric([route, status], [*buckets, ("+Inf", figures["count"])],
                           sum_value=figures["sum"])  # fmt: skip
    now = time.time()
    client.zremrangebyscore(IN_FLIGHT, "-inf", now)
    flying = GaugeMetricFamily(
        "sdq_serve_requests_in_flight", "Requests to `sdq serve` not answered yet"
    )
    flying.add_metric([], client.zcard(IN_FLIGHT))
    yield from (latency, flying)


def _latencies(client: redis.Redis) -> dict[tuple[str, str], dict[str, float]]:
    figures: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for field, value in client.hgetall(LATENCY).items():
        route, status, part = field.decode().split(SEPARATOR)
        figures[route, status][part] = float(value)
    return {labels: parts for labels, parts in figures.items() if "count" in parts}

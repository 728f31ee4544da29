"""What `sdq serve` answers besides its routes: OpenAI's error body for every refusal and
outage (which its clients read), the body's size limit, and each route's latency for
Prometheus."""

from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError as BrokerError
from redis.exceptions import RedisError
from sqlalchemy.exc import DBAPIError

from sdq.models.store import StoreError
from sdq.producer.generate.serve.limits import Exceeded
from sdq.producer.generate.serve.requests import Refusal
from sdq.producer.generate.serve.submitting import NotSent

MAX_BODY_BYTES = 1 << 20
# A body over the limit but under this is read before the 413, so that its client hears it.
DRAINED_BYTES = 16 << 20


class Answer(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_answer(
    status: int,
    message: str,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    **more: Any,
) -> JSONResponse:
    """OpenAI's error body, which its clients read."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}, **more}
    return JSONResponse(body, status_code=status, headers=headers)


def add_error_answers(api: FastAPI) -> None:
    @api.exception_handler(Answer)
    async def answered(request: Request, error: Answer) -> JSONResponse:
        return error_answer(error.status, error.message, param=error.param, headers=error.headers)

    @api.exception_handler(Refusal)
    async def refused(request: Request, error: Refusal) -> JSONResponse:
        return error_answer(error.status, f"{error.field}: {error.message}", param=error.field)

    @api.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first["type"] == "json_invalid":  # its loc is ("body", the character it failed at)
            reason = first.get("ctx", {}).get("error", "JSON decode error")
            where = f"{reason} at character {first['loc'][-1]}"
            return error_answer(422, f"body: not JSON: {where}", param="body")
        field = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
        return error_answer(
            422,
            f"{field}: {first['msg']}",
            param=field,
            detail=orjson.loads(orjson.dumps(error.errors(), default=str)),
        )

    @api.exception_handler(Exceeded)
    async def exceeded(request: Request, error: Exceeded) -> JSONResponse:
        return error_answer(429, error.message, headers={"Retry-After": str(error.retry_after)})

    for outage in (DBAPIError, BrokerError, RedisError, StoreError, NotSent):

        @api.exception_handler(outage)
        async def unavailable(request: Request, error: Exception) -> JSONResponse:
            return error_answer(
                503, f"not served now, try again soon: {error}", headers={"Retry-After": "5"}
            )


async def limit_body(request: Request, call_next):
    """413 for a body over 1 MB by the length it declares, read and dropped first where it
    is not huge (a client that is still sending reads no answer before it is done); a
    body that declares no length (chunked) is not read at all: 411."""
    if request.method == "POST":
        declared = request.headers.get("content-length")
        if declared is None:
            return error_answer(411, "a request body must say its Content-Length")
        if not declared.isdigit() or int(declared) > MAX_BODY_BYTES:
            if declared.isdigit() and int(declared) <= DRAINED_BYTES:
                async for _ in request.stream():
                    pass
            return error_answer(413, f"the body is over {MAX_BODY_BYTES} bytes")
    return await call_next(request)

"""The plain way to serve Stable Diffusion over HTTP, as ../shared/seeds/002 lays it out: a
FastAPI front and one pipeline per worker process (one per GPU), requests spread over them
round robin, each answered with its PNG. Imports nothing from sdq.

    python benchmarks/plain_serve.py MODEL_FOLDER --port 8001 [--workers 1]
"""

import argparse
import asyncio
import base64
import io
import itertools
import multiprocessing
import threading

import torch
import uvicorn
from diffusers import StableDiffusionPipeline
from fastapi import FastAPI
from pydantic import BaseModel


class Generate(BaseModel):
    prompt: str
    seed: int = 0
    steps: int = 25
    width: int = 512
    height: int = 512


def render_forever(folder: str, gpu: int, inbox, outbox) -> None:
    """One process, one pipeline, loaded once."""
    device = f"cuda:{gpu}" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device != "cpu" else torch.float32
    pipeline = StableDiffusionPipeline.from_pretrained(folder, torch_dtype=dtype).to(device)
    pipeline.set_progress_bar_config(disable=True)
    outbox.put(("ready", None))
    while True:
        request_id, asked = inbox.get()
        image = pipeline(
            prompt=asked["prompt"],
            num_inference_steps=asked["steps"],
            width=asked["width"],
            height=asked["height"],
            generator=torch.Generator(device).manual_seed(asked["seed"]),
        ).images[0]
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        outbox.put((request_id, buffer.getvalue()))


def create_app(folder: str, workers: int) -> FastAPI:
    context = multiprocessing.get_context("spawn")
    outbox = context.Queue()
    inboxes = [context.Queue() for _ in range(workers)]
    for gpu, inbox in enumerate(inboxes):
        context.Process(
            target=render_forever, args=(folder, gpu, inbox, outbox), daemon=True
        ).start()
    for _ in inboxes:
        assert outbox.get()[0] == "ready"
    turns = itertools.cycle(inboxes)
    waiting: dict[int, asyncio.Future] = {}
    ids = itertools.count()
    app = FastAPI()

    def answers(loop: asyncio.AbstractEventLoop) -> None:
        while True:
            request_id, png = outbox.get()
            future = waiting.pop(request_id)
            loop.call_soon_threadsafe(future.set_result, png)

    @app.on_event("startup")
    async def listen() -> None:
        loop = asyncio.get_running_loop()
        threading.Thread(target=answers, args=(loop,), daemon=True).start()

    @app.post("/generate")
    async def generate(asked: Generate) -> dict[str, str]:
        request_id = next(ids)
        waiting[request_id] = asyncio.get_running_loop().create_future()
        next(turns).put((request_id, asked.model_dump()))
        png = await waiting[request_id]
        return {"b64_json": base64.b64encode(png).decode()}

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--workers", type=int, default=max(1, torch.cuda.device_count()))
    args = parser.parse_args()
    uvicorn.run(create_app(args.folder, args.workers), host="127.0.0.1", port=args.port)

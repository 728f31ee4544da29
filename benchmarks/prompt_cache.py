"""The text-embedding cache of a generate worker, against diffusers' own way, in one run.

A prompt file as people write them: subjects crossed with styles, `--n` images (seeds) of
each, one negative prompt for all. Rendered in calls of `--batch-size` images:
  (a) plain: each call's prompts and negative prompts through the text encoder, as the
      pipeline does when it is handed text;
  (b) sdq: the worker's PromptEmbeddings, which encodes only the texts it has not seen;
  (c) the same prompts rendered again (more seeds, or a fine-tune with the same text
      encoder) on a second worker at the same time, each worker going through the calls
      from its own end: each with its own cache, then both sharing one Redis
      (SDQ_PROMPT_CACHE_URL; a redis-server started here), where each text is encoded
      once across both (but for the texts both reach at the same moment).
The text encoder is Stable Diffusion 1.5's (CLIP ViT-L/14's text tower: 12 layers, width
768) with random weights, built in code; the U-Net is not run, since the cache does not
touch it: a call's saving is the (a) - (b) seconds on top of its denoising. Prints one
JSON object; `sdq_vs_plain` is (a)/(b) for the text encoding.

    python benchmarks/prompt_cache.py [--subjects 16] [--styles 8] [--n 4] [--batch-size 8]
"""

import argparse
import json
import multiprocessing
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sd15 import sd15_text_encoder  # noqa: E402  (beside this script)

from sdq.workers.generate.conditioning import PromptEmbeddings, family_encoder  # noqa: E402
from sdq.workers.tiny import build_pipeline  # noqa: E402

NEGATIVE = "blurry, low quality, watermark"


def sd15_text_pipeline():
    """tiny's pipeline with Stable Diffusion 1.5's text encoder (random weights, the same
    in every process: one text encoder)."""
    pipeline = build_pipeline()
    torch.manual_seed(0)
    pipeline.text_encoder = sd15_text_encoder().eval()
    return pipeline


def calls(subjects: int, styles: int, n: int, batch_size: int) -> list[list[str]]:
    """The prompt file's images in order (each prompt's n seeds together), cut into calls."""
    prompts = [f"subject {a}, style {b}" for a in range(subjects) for b in range(styles)]
    images = [prompt for prompt in prompts for _ in range(n)]
    return [images[start : start + batch_size] for start in range(0, len(images), batch_size)]


def plain(pipeline, batches: list[list[str]]) -> tuple[float, int]:
    started = time.perf_counter()
    with torch.inference_mode():
        for prompts in batches:
            pipeline.encode_prompt(prompts, pipeline.device, 1, True, [NEGATIVE] * len(prompts))
    return time.perf_counter() - started, sum(2 * len(prompts) for prompts in batches)


def cached(pipeline, batches: list[list[str]]) -> tuple[float, int]:
    embeddings = PromptEmbeddings(family_encoder(pipeline), 1024)
    started = time.perf_counter()
    with torch.inference_mode():
        for prompts in batches:
            embeddings(pipeline, prompts)
            embeddings(pipeline, [NEGATIVE] * len(prompts))
    return time.perf_counter() - started, embeddings.encoded


def two_workers(batches: list[list[str]], url: str | None) -> int:
    """Texts encoded by two worker processes at once, one taking the calls in order, the
    other from the last."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        return sum(pool.starmap(worker_encodes, [(batches, url), (batches[::-1], url)]))


def worker_encodes(batches: list[list[str]], url: str | None) -> int:
    from sdq.workers.generate.shared_prompts import SharedPrompts, text_encoder_digest

    torch.set_num_threads(1)
    pipeline = sd15_text_pipeline()
    shared = url and SharedPrompts(url, 10_000).for_encoder(text_encoder_digest(pipeline))
    embeddings = PromptEmbeddings(family_encoder(pipeline), 1024, shared or None)
    with torch.inference_mode():
        for prompts in batches:
            embeddings(pipeline, prompts)
            embeddings(pipeline, [NEGATIVE] * len(prompts))
    return embeddings.encoded


@contextmanager
def redis_server() -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(100):
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subjects", type=int, default=16)
    parser.add_argument("--styles", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    pipeline = sd15_text_pipeline()
    batches = calls(args.subjects, args.styles, args.n, args.batch_size)
    plain(pipeline, batches[:2])  # warm up: the first calls allocate
    plain_seconds, plain_texts = plain(pipeline, batches)
    sdq_seconds, sdq_texts = cached(pipeline, batches)
    with redis_server() as url:
        own, shared = two_workers(batches, None), two_workers(batches, url)
    images = sum(map(len, batches))
    print(json.dumps({
        "images": images, "calls": len(batches), "device": str(pipeline.device),
        "threads": torch.get_num_threads(),
        "texts_encoded": {"plain": plain_texts, "sdq": sdq_texts},
        "encode_ms_per_image": {"plain": round(1000 * plain_seconds / images, 2),
                                "sdq": round(1000 * sdq_seconds / images, 2)},
        "sdq_vs_plain": round(plain_seconds / sdq_seconds, 2),
        "two_workers_texts_encoded": {"own_caches": own, "shared": shared,
                                      "distinct_texts": sdq_texts},
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()

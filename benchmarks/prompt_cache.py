"""The text-embedding cache of a generate worker, against diffusers' own way, in one run.

A prompt file as people write them: subjects crossed with styles, `--n` images (seeds) of
each, one negative prompt for all. Rendered in calls of `--batch-size` images:
  (a) plain: each call's prompts and negative prompts through the text encoder, as the
      pipeline does when it is handed text;
  (b) sdq: the worker's PromptEmbeddings, which encodes only the texts it has not seen.
The text encoder is Stable Diffusion 1.5's (CLIP ViT-L/14's text tower: 12 layers, width
768) with random weights, built in code; the U-Net is not run, since the cache does not
touch it: a call's saving is the (a) - (b) seconds on top of its denoising. Prints one
JSON object; `sdq_vs_plain` is (a)/(b) for the text encoding.

    python benchmarks/prompt_cache.py [--subjects 16] [--styles 8] [--n 4] [--batch-size 8]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdq.workers.generate.pipelines import PromptEmbeddings  # noqa: E402
from sdq.workers.sd15 import sd15_text_encoder  # noqa: E402
from sdq.workers.tiny import build_pipeline  # noqa: E402

NEGATIVE = "blurry, low quality, watermark"


def sd15_text_pipeline():
    """tiny's pipeline with Stable Diffusion 1.5's text encoder (random weights)."""
    pipeline = build_pipeline()
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
    embeddings = PromptEmbeddings(1024)
    started = time.perf_counter()
    with torch.inference_mode():
        for prompts in batches:
            embeddings(pipeline, prompts)
            embeddings(pipeline, [NEGATIVE] * len(prompts))
    return time.perf_counter() - started, embeddings.encoded


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
    images = sum(map(len, batches))
    print(json.dumps({
        "images": images, "calls": len(batches), "device": str(pipeline.device),
        "threads": torch.get_num_threads(),
        "texts_encoded": {"plain": plain_texts, "sdq": sdq_texts},
        "encode_ms_per_image": {"plain": round(1000 * plain_seconds / images, 2),
                                "sdq": round(1000 * sdq_seconds / images, 2)},
        "sdq_vs_plain": round(plain_seconds / sdq_seconds, 2),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()

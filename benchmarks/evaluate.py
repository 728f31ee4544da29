"""Scoring a checkpoint's renders: sdq's evaluate worker against a plain torchmetrics
script (benchmarks/plain_evaluate.py, which imports nothing of sdq), on the same images.

A CLIP model with random weights, built here and saved as a transformers folder: ViT-L/14's
shape on a GPU (the model clip_score and fd_clip are reported with), a width-reduced one on
a CPU. N renders (PNGs with their prompts) and N real images (JPEGs of another size), made
once, untimed. Then, in interleaved rounds, each side scores them from their bytes: the
CLIP score of each render against its prompt, and the Fréchet distance and KID between the
renders' and the real images' CLIP embeddings. Prints one JSON object: each side's images
scored per second (medians over rounds), `sdq_vs_plain`, and each metric's values and their
relative difference.

    python benchmarks/evaluate.py [--images 256] [--rounds 3] [--batch-size 32] [--full-shape]

`--full-shape` takes ViT-L/14's shape on a CPU too (slow: for the figure at that shape where
no GPU is at hand).
"""

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import CLIPModel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.clips import VIT_L14_TEXT, VIT_L14_VISION, VIT_L14_WIDTH, build_clip  # noqa: E402
from benchmarks.plain_evaluate import PlainScorer  # noqa: E402
from sdq.models.curate.clip import ScorerRef, resolve_clip  # noqa: E402
from sdq.workers.curate.scoring import LoadedScorers  # noqa: E402
from sdq.workers.evaluate import metrics  # noqa: E402
from sdq.workers.weights import ModelFiles  # noqa: E402


def clip_folder(folder: Path, full_shape: bool) -> Path:
    """ViT-L/14's shape, or a width-reduced CLIP (benchmarks/clips.py). Random
    towers disagree as often as not: turned round where they mostly do, its CLIP scores are
    positive values to compare rather than a clamp's 0s."""
    shape = (VIT_L14_VISION, VIT_L14_TEXT, VIT_L14_WIDTH) if full_shape else ()
    build_clip(folder, *shape)
    model = CLIPModel.from_pretrained(folder).eval()
    size = model.config.vision_config.image_size
    with torch.no_grad():
        out = model(input_ids=torch.arange(1, 9)[None].repeat(4, 1),
                    pixel_values=torch.randn(4, 3, size, size))  # fmt: skip
        if (out.image_embeds * out.text_embeds).sum() < 0:
            model.text_projection.weight.neg_()
            model.save_pretrained(folder)
    return folder


def images(count: int, size: tuple[int, int], image_format: str, seed: int) -> list[bytes]:
    draw = np.random.default_rng(seed)
    made = []
    for _ in range(count):
        # Smooth noise: an image's worth of structure for the decoder and the resize.
        small = draw.integers(0, 256, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize(size, Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        image.save(buffer, format=image_format)
        made.append(buffer.getvalue())
    return made


def sdq_side(scorer, renders: list[bytes], prompts: list[str], real: list[bytes]) -> dict:
    """What an evaluate job computes of its renders (workers/evaluate/work.py)."""
    fake, clip_scores = metrics.clip_scores(scorer, renders, prompts)
    reference = metrics.image_embeddings(scorer, real)
    return {
        "clip_score": float(clip_scores.mean()),
        "fd_clip": metrics.frechet_distance(fake, reference),
        "kid": metrics.kernel_distance(fake, reference),
    }


def plain_side(plain: PlainScorer, renders: list[bytes], prompts: list[str], real: list[bytes]):
    def opened(data: bytes) -> Image.Image:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")

    return plain.score([opened(d) for d in renders], prompts, [opened(d) for d in real])


def timed(score) -> tuple[dict, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    values = score()
    return values, time.perf_counter() - started


def _relative(value: float, wanted: float) -> float:
    return abs(value - wanted) / max(abs(wanted), 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256, help="renders, and as many real")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--full-shape", action="store_true", help="ViT-L/14's shape on a CPU")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    full_shape = gpu or args.full_shape
    with tempfile.TemporaryDirectory() as scratch:
        folder = clip_folder(Path(scratch) / "clip", full_shape)
        found = resolve_clip(str(folder))
        scorer = LoadedScorers(ModelFiles(None, Path(scratch)), None).get(
            ScorerRef(found.source, found.revision)
        )
        metrics.CLIP_BATCH = args.batch_size
        plain = PlainScorer(folder, "cuda" if gpu else "cpu", scorer.dtype, args.batch_size)
        renders = images(args.images, (256, 256), "PNG", seed=1)
        real = images(args.images, (320, 240), "JPEG", seed=2)
        prompts = [f"a picture of thing number {n}" for n in range(args.images)]
        speeds: dict[str, list[float]] = {"sdq": [], "plain": []}
        for _ in range(args.rounds):
            ours, seconds = timed(lambda: sdq_side(scorer, renders, prompts, real))
            speeds["sdq"].append(2 * args.images / seconds)
            theirs, seconds = timed(lambda: plain_side(plain, renders, prompts, real))
            speeds["plain"].append(2 * args.images / seconds)
    sdq, plain_speed = statistics.median(speeds["sdq"]), statistics.median(speeds["plain"])
    values = {
        name: {"sdq": ours[name], "plain": theirs[name],
               "relative_difference": _relative(ours[name], theirs[name])}
        for name in ours
    }  # fmt: skip
    print(json.dumps({
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "clip": "ViT-L/14 shape" if full_shape else "width-reduced",
        "images": 2 * args.images,
        "sdq_images_per_s": round(sdq, 1),
        "plain_images_per_s": round(plain_speed, 1),
        "sdq_vs_plain": round(sdq / plain_speed, 3),
        "values": values,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()

"""The plain way to score image shards with CLIP, as a curation script does it: each shard
read from S3, its images decoded and preprocessed by CLIP's image processor, batch after
batch through CLIP and an aesthetic head, embeddings and scores written to local parquet.
No queue, no database, and nothing of sdq's: what `sdq curate` is measured against by
benchmarks/curate.py.

    python benchmarks/plain_curate.py --bucket B --clip DIR --head FILE --batch-size N KEY...

Prints one JSON object: the samples scored and the loop's own seconds (the command's
imports and model load left out).
"""

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import CLIPImageProcessorPil, CLIPModel, CLIPTokenizer


class PlainScorer:
    """CLIP, its processor and tokenizer, and an aesthetic head, as a script loads them; a
    batch of JPEGs and their captions scored."""

    def __init__(self, clip: Path, head: Path, device="cpu", dtype=torch.float32) -> None:
        self.device, self.dtype = torch.device(device), dtype
        self.model = CLIPModel.from_pretrained(clip, dtype=dtype).to(device).eval()
        self.processor = CLIPImageProcessorPil.from_pretrained(clip)
        self.tokenizer = CLIPTokenizer.from_pretrained(clip)
        state = load_file(head)
        layers = []
        for index in (0, 2, 4, 6, 7):
            weight, bias = state[f"layers.{index}.weight"], state[f"layers.{index}.bias"]
            layer = torch.nn.Linear(weight.shape[1], weight.shape[0])
            layer.load_state_dict({"weight": weight, "bias": bias})
            layers.append(layer)
        self.head = torch.nn.Sequential(*layers).to(device).eval()

    @torch.inference_mode()
    def score(self, jpegs: list[bytes], captions: list[str]) -> dict[str, np.ndarray]:
        images = [Image.open(io.BytesIO(data)).convert("RGB") for data in jpegs]
        pixels = self.processor(images=images, return_tensors="pt").pixel_values
        tokens = self.tokenizer(captions, padding="max_length", max_length=77,
                                truncation=True, return_tensors="pt")  # fmt: skip
        out = self.model(**tokens.to(self.device),
                         pixel_values=pixels.to(self.device, self.dtype))  # fmt: skip
        image_embeds, text_embeds = out.image_embeds.float(), out.text_embeds.float()
        clip_score = (100 * (image_embeds * text_embeds).sum(-1)).clamp(min=0)
        return {
            "embedding": image_embeds.half().cpu().numpy(),
            "clip_score": clip_score.cpu().numpy(),
            "aesthetic": self.head(image_embeds).squeeze(-1).cpu().numpy(),
        }


def scores_table(keys, parts: list[dict[str, np.ndarray]]) -> pa.Table:
    """A shard's keys and its batches' scores as one table."""
    columns = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    width = columns["embedding"].shape[1]
    embeddings = pa.FixedSizeListArray.from_arrays(
        pa.array(columns.pop("embedding").reshape(-1)), width
    )
    return pa.table({"key": keys, "embedding": embeddings, **columns})


class PlainLoop:
    """Read a shard, score it batch by batch, save."""

    def __init__(self, bucket: str, clip: Path, head: Path, batch_size: int) -> None:
        import boto3  # here: PlainScorer is used where boto3 is not installed

        self.bucket = boto3.resource("s3").Bucket(bucket)
        self.batch_size = batch_size
        self.scorer = PlainScorer(clip, head)
        self.output = Path(tempfile.mkdtemp(prefix="sdq-plain-curate-"))

    def run(self, keys: list[str]) -> int:
        samples = 0
        for number, key in enumerate(keys):
            table = pq.read_table(io.BytesIO(self.bucket.Object(key).get()["Body"].read()))
            table = table.filter(pc.equal(table["status"], "success"))
            batches = [table.slice(start, self.batch_size)
                       for start in range(0, len(table), self.batch_size)]  # fmt: skip
            parts = [self.scorer.score(batch["jpg"].to_pylist(), batch["caption"].to_pylist())
                     for batch in batches]  # fmt: skip
            if parts:
                pq.write_table(scores_table(table["key"], parts),
                               self.output / f"{number:05d}.parquet")  # fmt: skip
            samples += len(table)
        return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--clip", type=Path, required=True)
    parser.add_argument("--head", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("keys", nargs="+")
    args = parser.parse_args()
    loop = PlainLoop(args.bucket, args.clip, args.head, args.batch_size)
    started = time.perf_counter()
    samples = loop.run(args.keys)
    print(json.dumps({"samples": samples, "loop_seconds": time.perf_counter() - started}))


if __name__ == "__main__":
    main()

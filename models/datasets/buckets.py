"""Aspect-ratio buckets: the shapes an image may be trained at, for one pixel area.

The list is SDXL's (its paper's appendix: width and height multiples of 64 from 1:4 to
4:1 at 1024² pixels), scaled to the area asked for and rounded again to multiples of 64,
so that every bucket's latents halve cleanly through the U-Net's downsamplings. An image
goes to the bucket of the nearest aspect ratio and is resized to cover it, then cropped:
of the whole list, that bucket crops it least. No torch, no Pillow here: the workers
resize, the producer and the tests reason about the same shapes.
"""

import math
from dataclasses import dataclass
from functools import cache

# SDXL's buckets at 1024 x 1024 pixels (its paper's table), as (width, height), tallest first.
SDXL_BUCKETS = (
    (512, 2048), (512, 1984), (512, 1920), (512, 1856), (576, 1792), (576, 1728),
    (576, 1664), (640, 1600), (640, 1536), (704, 1472), (704, 1408), (704, 1344),
    (768, 1344), (768, 1280), (832, 1216), (832, 1152), (896, 1152), (896, 1088),
    (960, 1088), (960, 1024), (1024, 1024), (1024, 960), (1088, 960), (1088, 896),
    (1152, 896), (1152, 832), (1216, 832), (1280, 768), (1344, 768), (1408, 704),
    (1472, 704), (1536, 640), (1600, 640), (1664, 576), (1728, 576), (1792, 576),
    (1856, 512), (1920, 512), (1984, 512), (2048, 512),
)  # fmt: skip
SDXL_SIDE = 1024
# Bucket sides are multiples of this: 8 latent pixels, which three halvings keep whole.
MULTIPLE = 64


@dataclass(frozen=True, order=True)
class Bucket:
    width: int
    height: int

    @property
    def name(self) -> str:
        return f"{self.width}x{self.height}"

    @classmethod
    def named(cls, name: str) -> "Bucket":
        """The bucket of a name, WIDTHxHEIGHT."""
        width, height = map(int, name.split("x"))
        return cls(width, height)

    @property
    def aspect(self) -> float:
        return self.width / self.height


@dataclass(frozen=True)
class Placement:
    """Where an image goes in its bucket: the bucket, and the offsets of the crop in the
    image resized to cover it (SDXL's crop_coords_top_left)."""

    bucket: Bucket
    scale: float  # resized size over the image's size
    top: int
    left: int


@cache
def buckets_for(side: int) -> tuple[Bucket, ...]:
    """The buckets for an area of side x side pixels, widest last, each shape once."""
    scale = side / SDXL_SIDE
    shapes = {
        Bucket(_rounded(width * scale), _rounded(height * scale)) for width, height in SDXL_BUCKETS
    }
    return tuple(sorted(shapes, key=lambda bucket: (bucket.aspect, bucket.width)))


def _rounded(length: float) -> int:
    return max(MULTIPLE, math.floor(length / MULTIPLE + 0.5) * MULTIPLE)


def nearest_bucket(buckets: tuple[Bucket, ...], width: int, height: int) -> Bucket:
    """The bucket whose aspect ratio is nearest the image's (as ratios: 2:1 is as far from
    1:1 as 1:2 is); between two as near, the smaller."""
    aspect = math.log(width / height)
    return min(buckets, key=lambda bucket: (abs(math.log(bucket.aspect) - aspect), bucket))


def place(buckets: tuple[Bucket, ...], width: int, height: int) -> Placement:
    """The image's bucket, and how it is resized to cover it and cropped in the middle."""
    bucket = nearest_bucket(buckets, width, height)
    scale = max(bucket.width / width, bucket.height / height)
    covered_width = max(bucket.width, round(width * scale))
    covered_height = max(bucket.height, round(height * scale))
    return Placement(
        bucket,
        scale,
        top=(covered_height - bucket.height) // 2,
        left=(covered_width - bucket.width) // 2,
    )

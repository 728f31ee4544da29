"""Mutated images for the download image path: seeds of every format the web serves
(PNG, JPEG, WebP, GIF, TIFF), each with the parts decoders trip on (EXIF, palettes,
alpha, frames, strips), mutated as a fuzzer does: bytes flipped, runs overwritten with
extreme values, cut short, spliced. The same seed gives the same cases."""

import io
import random
from collections.abc import Iterator

import numpy as np
from PIL import Image

EXTREMES = (b"\x00", b"\xff", b"\x7f", b"\x80", b"\xff\xff\xff\xff", b"\x00\x00\x00\x00")


def _picture(width: int, height: int) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x ^ y) & 255], -1)
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def _saved(image: Image.Image, image_format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, image_format, **options)
    return buffer.getvalue()


def seeds() -> dict[str, bytes]:
    picture = _picture(96, 80)
    exif = Image.Exif()
    exif[0x0112] = 6  # turned a quarter
    frames = [_picture(96, 80).rotate(angle) for angle in (0, 90, 180)]
    return {
        "jpeg": _saved(picture, "JPEG", quality=85, exif=exif.tobytes()),
        "progressive jpeg": _saved(picture, "JPEG", progressive=True),
        "png": _saved(picture, "PNG", exif=exif.tobytes()),
        "png palette alpha": _saved(picture.convert("P"), "PNG", transparency=0),
        "png 16-bit grey": _saved(Image.fromarray(np.full((80, 96), 40000, np.uint16)), "PNG"),
        "webp": _saved(picture, "WEBP", quality=80),
        "webp lossless alpha": _saved(picture.convert("RGBA"), "WEBP", lossless=True),
        "gif": _saved(frames[0], "GIF", save_all=True, append_images=frames[1:]),
        "tiff": _saved(picture, "TIFF", exif=exif.tobytes()),
        "tiff lzw": _saved(picture, "TIFF", compression="tiff_lzw"),
    }


def mutate(data: bytes, rng: random.Random) -> bytes:
    mutated = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(mutated))
        action = rng.choice(("flip", "extreme", "cut", "splice", "drop"))
        if action == "flip":
            for _ in range(rng.randint(1, 8)):
                mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
        elif action == "extreme":
            value = rng.choice(EXTREMES)
            mutated[at : at + len(value)] = value
        elif action == "cut":
            del mutated[max(8, at) :]
        elif action == "splice":
            start = rng.randrange(len(mutated))
            mutated[at:at] = mutated[start : start + rng.randint(1, 64)]
        else:
            del mutated[at : at + rng.randint(1, 64)]
        if not mutated:
            break
    return bytes(mutated)


def cases(count: int, seed: int = 0) -> Iterator[tuple[str, bytes]]:
    """`count` mutated images, spread over the seed images in turn."""
    rng = random.Random(seed)
    originals = list(seeds().items())
    for index in range(count):
        name, data = originals[index % len(originals)]
        yield name, mutate(data, rng)

"""Pixels as every kind that reads images wants them: plain 8-bit RGB, resized and cropped
as img2dataset does (download stores them so; encode makes what it reads so too)."""

import numpy as np
from PIL import Image

from sdq.models.datasets import ImageOptions
from sdq.models.datasets.buckets import Placement

BACKGROUND = (255, 255, 255)  # what transparent pixels become


def to_rgb(image: Image.Image) -> Image.Image:
    """Palette, alpha, CMYK, 16-bit and the rest to plain 8-bit RGB; transparency becomes
    white, not the black that a bare convert() leaves."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        pixels = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") or pixels.max() > 255 else 255.0
        image = Image.fromarray(np.clip(pixels / top * 255 + 0.5, 0, 255).astype(np.uint8), "L")
    elif image.mode == "F":
        image = Image.fromarray(np.clip(np.asarray(image), 0, 255).astype(np.uint8), "L")
    if image.mode == "RGB":
        return image
    if (image.mode == "P" and "transparency" in image.info) or image.mode in ("PA", "LA", "La"):
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "RGBa"):
        background = Image.new("RGB", image.size, BACKGROUND)
        background.paste(image, mask=image.getchannel("A"))
        return background
    return image.convert("RGB")


def resize(image: Image.Image, options: ImageOptions) -> Image.Image:
    """img2dataset's modes. center_crop: the short side to the resolution, then the middle
    square; keep_ratio: the short side to the resolution; keep_ratio_largest: the long side
    to it; border: the long side to the resolution, padded to a square with black; no: as
    it came."""
    size = options.resolution
    width, height = image.size
    if options.resize_mode == "no":
        return image
    if options.resize_mode == "border":
        fitted = _scaled(image, size / max(width, height))
        square = Image.new("RGB", (size, size))
        square.paste(fitted, ((size - fitted.width) // 2, (size - fitted.height) // 2))
        return square
    if options.resize_mode == "keep_ratio":
        return _scaled(image, size / min(width, height))
    if options.resize_mode == "keep_ratio_largest":
        return _scaled(image, size / max(width, height))
    # Only the middle square is resampled, straight to the resolution: the same picture as
    # resizing all of it and cropping, without the work on the sides that are cut off.
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return _scaled(image, size / side, box=(left, top, left + side, top + side))


def in_bucket(image: Image.Image, placement: Placement) -> Image.Image:
    """The image resized to cover its bucket and cropped to it, the crop's region alone
    resampled (as for center_crop)."""
    bucket, scale = placement.bucket, placement.scale
    left, top = placement.left / scale, placement.top / scale
    box = (left, top, left + bucket.width / scale, top + bucket.height / scale)
    if scale == 1:
        return image.crop(tuple(map(round, box)))
    return image.resize((bucket.width, bucket.height), _filter(scale), box=box)


def _scaled(
    image: Image.Image, scale: float, box: tuple[int, int, int, int] | None = None
) -> Image.Image:
    """The image, or the `box` of it, resized by `scale`."""
    left, top, right, bottom = box or (0, 0, image.width, image.height)
    if scale == 1:
        return image.crop(box) if box else image
    target = (max(1, round((right - left) * scale)), max(1, round((bottom - top) * scale)))
    return image.resize(target, _filter(scale), box=box)


def _filter(scale: float) -> Image.Resampling:
    """img2dataset's filters: area averaging down (cv2's INTER_AREA is Pillow's BOX), which
    does not alias and costs a third of Lanczos; Lanczos up, where area has nothing to
    average."""
    return Image.Resampling.BOX if scale < 1 else Image.Resampling.LANCZOS

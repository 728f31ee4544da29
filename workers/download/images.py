"""From downloaded bytes to a dataset image: checked, decoded in full, upright, RGB,
resized as the dataset asks and encoded again. Anything wrong is an `ImageRejected`
whose reason a person understands: a damaged file of any format ends as its row's
reason, never as an exception that would fail the whole slice."""

import io
import struct
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from sdq.models.datasets import ImageOptions
from sdq.workers.download.budget import PixelBudget
from sdq.workers.shards.pixels import resize, to_rgb

# Pillow's own bomb guard warns, then raises at twice its limit; sdq checks its own cap
# before decoding instead, so Pillow's is lifted to that cap's job.
Image.MAX_IMAGE_PIXELS = None
# Pillow warns of every damaged file it can still read (corrupt EXIF, truncated strips); a
# downloader meets millions, and the row's outcome says what matters.
warnings.filterwarnings("ignore", module=r"PIL\.")
SAVE_FORMATS = {"jpg": "JPEG", "webp": "WEBP", "png": "PNG"}
ORIENTATION = 0x0112  # the EXIF tag
# What Pillow's decoders raise on a damaged file, anywhere from the header to the last
# pixel (a PNG's EXIF is read by decoding the whole image, for one).
DECODE_ERRORS = (
    OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError, KeyError,
    ZeroDivisionError,
)  # fmt: skip


class ImageRejected(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class DatasetImage:
    data: bytes
    width: int
    height: int
    original_width: int
    original_height: int


def make_image(
    data: bytes, options: ImageOptions, *, max_pixels: int, budget: PixelBudget | None = None
) -> DatasetImage:
    """The dataset's image of `data`. Its decoded pixels count against `budget` (the
    worker's, shared by its threads) from the first decoded byte to the last encoded one."""
    with _decoding():
        image = _open(data, max_pixels)
    if min(image.size) < options.min_size:  # the short side, whichever way up it is shown
        raise ImageRejected("image too small")
    stored_size = image.size
    _reduce_while_decoding(image, options)
    with budget.reserve(image.width * image.height) if budget else nullcontext():
        with _decoding():
            original = _upright_size(image, stored_size)
            image.load()
            ImageOps.exif_transpose(image, in_place=True)
            rgb = to_rgb(image)
        resized = resize(rgb, options)
        return DatasetImage(encode(resized, options), *resized.size, *original)


@contextmanager
def _decoding() -> Iterator[None]:
    try:
        yield
    except UnidentifiedImageError:
        raise ImageRejected("not an image") from None
    except DECODE_ERRORS as error:
        raise ImageRejected(_decode_failure(error)) from None


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """Reads only the header: the pixel count is known before anything is decoded."""
    image = Image.open(io.BytesIO(data))
    if image.width * image.height > max_pixels:
        raise ImageRejected("decompression bomb")
    return image


def _decode_failure(error: Exception) -> str:
    return "truncated image" if "truncated" in str(error).lower() else "unreadable image"


def _reduce_while_decoding(image: Image.Image, options: ImageOptions) -> None:
    """JPEGs decode at 1/2, 1/4 or 1/8 scale (Pillow's draft mode) when the result still
    has at least twice the resolution the resize keeps along the side it measures: the
    final resize then gives the image a full decode gives (a test bounds the difference),
    at a fraction of the decoding work."""
    if image.format != "JPEG" or options.resize_mode == "no":
        return
    width, height = image.size
    side = min(width, height) if options.resize_mode == "center_crop" else max(width, height)
    scale = 2 * options.resolution / side
    if scale < 1:
        image.draft("RGB", (int(width * scale) + 1, int(height * scale) + 1))


def _upright_size(image: Image.Image, stored_size: tuple[int, int]) -> tuple[int, int]:
    """The size as stored, as a viewer shows it: EXIF orientations 5 to 8 turn the picture
    a quarter."""
    width, height = stored_size
    if image.getexif().get(ORIENTATION, 1) in (5, 6, 7, 8):
        return height, width
    return width, height


def encode(image: Image.Image, options: ImageOptions) -> bytes:
    buffer = io.BytesIO()
    save_format = SAVE_FORMATS[options.format]
    if save_format == "PNG":
        image.save(buffer, save_format)
    else:
        image.save(buffer, save_format, quality=options.quality)
    return buffer.getvalue()

"""From downloaded bytes to dataset images: orientation, colour modes, resize modes, the
reduced-size JPEG decode, and a bomb refused before it costs memory."""

import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from sdq.models.datasets import ImageOptions
from sdq.workers.download.images import ImageRejected, make_image
from tests.conftest import ROOT
from tests.hostile_server import bomb, cmyk, exif_rotated, jpeg, palette_with_alpha, sixteen_bit

MAX_PIXELS = 90_000_000


def decoded(data: bytes, **options) -> tuple[np.ndarray, object]:
    made = make_image(data, ImageOptions(format="png", **options), max_pixels=MAX_PIXELS)
    return np.asarray(Image.open(io.BytesIO(made.data))), made


def test_exif_orientation_is_applied_before_cropping() -> None:
    pixels, made = decoded(exif_rotated(), resolution=64, resize_mode="keep_ratio")
    assert (made.original_width, made.original_height) == (100, 200)  # shown upright
    assert pixels.shape == (128, 64, 3)


def test_transparent_palette_pixels_become_white() -> None:
    pixels, _ = decoded(palette_with_alpha(), resolution=64)
    assert (pixels[:, :24] == 255).all()  # the transparent half
    assert (pixels[:, 40:] == [255, 0, 0]).all()  # the opaque red half


def test_cmyk_comes_out_as_its_rgb_colour() -> None:
    pixels, _ = decoded(cmyk(), resolution=64)
    assert np.abs(pixels.reshape(-1, 3).mean(0) - [255, 0, 0]).max() < 8


def test_sixteen_bit_grey_keeps_its_range_in_eight_bits() -> None:
    pixels, _ = decoded(sixteen_bit(), resolution=128, resize_mode="no")
    row = pixels[0, :, 0]
    assert row[0] <= 1 and row[-1] >= 254
    assert (np.diff(row.astype(int)) >= 0).all()


@pytest.mark.parametrize(
    ("mode", "size"),
    [
        ("center_crop", (64, 64)),
        ("keep_ratio", (114, 64)),
        ("keep_ratio_largest", (64, 36)),
        ("border", (64, 64)),
        ("no", (640, 360)),
    ],
)
def test_resize_modes_give_img2dataset_sizes(mode: str, size: tuple[int, int]) -> None:
    pixels, made = decoded(jpeg(640, 360), resolution=64, resize_mode=mode)
    assert (made.width, made.height) == size == pixels.shape[1::-1]
    if mode == "border":
        assert (pixels[:10] == 0).all()  # padded top band


def test_reduced_size_decoding_gives_the_full_decode_result() -> None:
    """Draft mode decodes a 1600x1200 JPEG at a fraction of its size; after the resize to
    256 the image matches a full decode's to within JPEG noise."""
    data = jpeg(1600, 1200, seed=7)
    fast, _ = decoded(data, resolution=256)
    full = Image.open(io.BytesIO(data))
    full.load()
    width, height = full.size
    scaled = full.resize((round(width * 256 / height), 256), Image.Resampling.BOX)
    left = (scaled.width - 256) // 2
    reference = np.asarray(scaled.crop((left, 0, left + 256, 256)))
    assert np.abs(fast.astype(int) - reference.astype(int)).mean() < 3


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"<html>", "not an image"),
        (jpeg(320, 240)[:3000], "truncated image"),
        (jpeg(40, 300), "image too small"),
        (bomb(), "decompression bomb"),
    ],
)
def test_bad_bytes_are_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(ImageRejected) as refused:
        make_image(data, ImageOptions(), max_pixels=MAX_PIXELS)
    assert refused.value.reason == reason


def test_a_bomb_is_refused_before_it_is_decoded() -> None:
    """144 million pixels claimed in 50 kB: decoding would take over 400 MB of RGB. The
    process that refuses it stays near its size at start."""
    script = (
        "import resource, sys\n"
        "from sdq.models.datasets import ImageOptions\n"
        "from sdq.workers.download.images import ImageRejected, make_image\n"
        "from tests.hostile_server import bomb\n"
        "data = bomb()\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    make_image(data, ImageOptions(), max_pixels=90_000_000)\n"
        "except ImageRejected as refused:\n"
        "    print(refused.reason, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    *reason, grown_kb = result.stdout.split()
    assert " ".join(reason) == "decompression bomb"
    assert int(grown_kb) < 20_000

"""One hostile row never fails its slice: thousands of mutated images of every format end
as per-row reasons, and an error nobody foresaw becomes its row's reason, logged once."""

import logging
from collections import Counter

import pytest

from sdq.models.datasets import ImageOptions, ListColumns, SampleStatus
from sdq.models.download.settings import DownloadSettings
from sdq.models.download.specs import SliceSpec
from sdq.workers.download.fetch import Fetched, Fetcher
from sdq.workers.download.images import ImageRejected, make_image
from sdq.workers.download.shards import ShardRow
from sdq.workers.download.work import DownloadWork
from tests.image_fuzz import cases, seeds

# Pillow warns of the damage it reads past; the outcome is what is tested.
pytestmark = pytest.mark.filterwarnings("ignore:::PIL")

# Every reason the image path gives; anything else, or an exception, is a defect.
IMAGE_REASONS = {
    "not an image", "unreadable image", "truncated image", "decompression bomb",
    "image too small",
}  # fmt: skip


def test_thousands_of_mutated_images_end_as_reasons_not_exceptions() -> None:
    outcomes: Counter[str] = Counter()
    for _, data in cases(3000):
        try:
            make_image(data, ImageOptions(resolution=64), max_pixels=90_000_000)
            outcomes["success"] += 1
        except ImageRejected as refused:
            outcomes[refused.reason] += 1
    assert set(outcomes) - {"success"} <= IMAGE_REASONS
    # The mutations reach the decoders, not only the headers: some still decode, most are
    # refused for what the decoder found.
    assert outcomes["success"] and outcomes["unreadable image"] and outcomes["truncated image"]


@pytest.mark.parametrize("name", sorted(seeds()))
def test_every_fuzz_seed_decodes_before_it_is_mutated(name: str) -> None:
    made = make_image(seeds()[name], ImageOptions(resolution=64), max_pixels=90_000_000)
    assert (made.width, made.height) == (64, 64)


class FailingFetcher(Fetcher):
    """A fetch that fails as no one foresaw, for one URL."""

    def fetch(self, url: str) -> Fetched:
        if url.endswith("/bug"):
            raise RuntimeError("a bug in a library")
        return Fetched(seeds()["png"], url)


def test_an_unforeseen_error_fails_its_row_alone_and_is_logged_once(caplog) -> None:
    settings = DownloadSettings()
    work = DownloadWork(store=None, sessions=None, fetcher=FailingFetcher(settings),
                        settings=settings)  # fmt: skip
    spec = SliceSpec(dataset="d", shard=0, source_uri="list.csv", source_id="x", first_row=0,
                     row_count=2, key_digits=1, columns=ListColumns(),
                     image=ImageOptions(resolution=64))  # fmt: skip
    broken = ShardRow(key="000000000", url="http://example.com/bug", caption="a")
    good = ShardRow(key="000000001", url="http://example.com/fine.png", caption="b")
    with caplog.at_level(logging.ERROR):
        for row in (broken, good):
            work._fetch(spec, row)
    assert (broken.status, broken.error_message) == (
        SampleStatus.failed,
        "unexpected error: RuntimeError",
    )
    assert good.status == SampleStatus.success and good.image
    [logged] = caplog.records
    assert "000000000" in logged.getMessage() and logged.exc_info[0] is RuntimeError

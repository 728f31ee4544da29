"""How many decoded pixels a worker process's download threads hold at once. Bytes on the
wire are capped per image; decoded pixels are what can take a worker to gigabytes (eight
threads each decoding an 80-megapixel PNG: 2 GB of RGB), so each image reserves its
pixels before it is decoded and gives them back once it is encoded again."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class PixelBudget:
    def __init__(self, pixels: int) -> None:
        self.pixels = pixels
        self.held = 0
        self._changed = threading.Condition()

    @contextmanager
    def reserve(self, pixels: int) -> Iterator[None]:
        """Waits until `pixels` fit beside what the other threads hold. An image larger
        than the whole budget waits until it holds the budget alone."""
        wanted = min(pixels, self.pixels)
        with self._changed:
            self._changed.wait_for(lambda: self.held + wanted <= self.pixels)
            self.held += wanted
        try:
            yield
        finally:
            with self._changed:
                self.held -= wanted
                self._changed.notify_all()

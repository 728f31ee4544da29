"""How download workers fetch: threads, timeouts, retries, the limits on what they take, and
the networks they may reach. Read with the other settings (models/settings.py)."""

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sdq.models.settings import setting


def _networks(env: Mapping[str, str], name: str, default: Any) -> tuple[str, ...]:
    """Comma-separated CIDRs, each checked now so a typo stops the process at start."""
    networks = tuple(part.strip() for part in env.get(name, "").split(",") if part.strip())
    for network in networks:
        try:
            ipaddress.ip_network(network, strict=False)
        except ValueError:
            raise ValueError(f"{name}: {network!r} is not a network (e.g. 127.0.0.0/8)") from None
    return networks


@dataclass(frozen=True, kw_only=True)
class DownloadSettings:
    # Fetches at once per worker process: downloading waits on the network, not the CPU.
    threads: int = setting("SDQ_DOWNLOAD_THREADS", 32)
    connect_timeout: float = setting("SDQ_DOWNLOAD_CONNECT_TIMEOUT", 10.0)
    # Also the cap on one fetch: redirects, headers and body.
    read_timeout: float = setting("SDQ_DOWNLOAD_TIMEOUT", 20.0)
    # Further tries of a fetch that failed for a passing reason (timeout, reset, 429, 5xx).
    retries: int = setting("SDQ_DOWNLOAD_RETRIES", 2, minimum=0)
    max_bytes: int = setting("SDQ_DOWNLOAD_MAX_BYTES", 32 * 1024 * 1024)
    max_redirects: int = setting("SDQ_DOWNLOAD_MAX_REDIRECTS", 5, minimum=0)
    # Images with more pixels are refused before decoding: a few bytes can claim gigapixels.
    max_pixels: int = setting("SDQ_DOWNLOAD_MAX_PIXELS", 90_000_000)
    # Decoded pixels a worker process's threads hold at once: an image waits until its
    # pixels fit, so a slice of huge images takes its memory in turns, not all at once.
    # Three bytes (RGB) a pixel, plus a working copy while it is resized.
    pixel_budget: int = setting("SDQ_DOWNLOAD_PIXEL_BUDGET", 180_000_000)
    # CIDRs that may be fetched although private or local (e.g. 127.0.0.0/8 for tests).
    allow_networks: tuple[str, ...] = setting("SDQ_DOWNLOAD_ALLOW_NETWORKS", (), read=_networks)

    def __post_init__(self) -> None:
        if self.pixel_budget < self.max_pixels:
            raise ValueError(
                f"SDQ_DOWNLOAD_PIXEL_BUDGET ({self.pixel_budget}) must be at least "
                f"SDQ_DOWNLOAD_MAX_PIXELS ({self.max_pixels}): the largest image allowed "
                "must fit in it"
            )

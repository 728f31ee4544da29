"""Fetching one image from a URL someone else wrote: only http(s), never to a private,
local or metadata address, within byte, time and redirect caps, and honouring opt-outs.

The address check runs where the socket connects (urllib3's `_new_conn`), on the very
addresses the connection then uses, for the first URL and for every redirect target: a
name that resolves to a public address when checked and a private one when used (DNS
rebinding) cannot slip between the two.
"""

import email.utils
import ipaddress
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urljoin, urlsplit

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import HTTPError, ProtocolError, TimeoutError

from sdq.models.datasets import is_transient
from sdq.models.settings import DownloadSettings

READ_CHUNK = 64 * 1024
REDIRECTS = (301, 302, 303, 307, 308)
# img2dataset's default: these X-Robots-Tag directives mean "not for training".
OPT_OUT_TOKENS = frozenset({"noai", "noimageai"})
USER_AGENT = "sdq-download/0.1 (+https://github.com/sdq/sdq)"
# A Retry-After longer than this is not waited for: the thread has other images to fetch.
MAX_RETRY_AFTER = 10.0
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class FetchFailed(Exception):
    """The image could not be had; `reason` says why in words. A server that names when
    to come back (Retry-After) is asked again then, if that is soon."""

    def __init__(self, reason: str, *, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after

    @property
    def transient(self) -> bool:
        return is_transient(self.reason)

    def pause(self, attempt: int) -> float:
        """Seconds before the next try: the server's word, else exponential backoff."""
        return self.retry_after if self.retry_after is not None else 0.5 * 2**attempt


class BlockedAddress(Exception):
    """Raised inside the connection, so no packet leaves for a refused address."""


@dataclass(frozen=True)
class Fetched:
    data: bytes
    url: str  # after redirects


def is_blocked(address: Address, allowed: Iterable[Network]) -> bool:
    """Anything not globally routable is refused unless named in `allowed`: loopback,
    private, link-local (cloud metadata at 169.254.169.254), multicast, reserved, and
    the IPv4-mapped and 6to4 forms of them."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = address.ipv4_mapped or address.sixtofour
        if inner is not None:
            return is_blocked(inner, allowed)
    if any(address in network for network in allowed):
        return False
    return not address.is_global or address.is_multicast


def _guarded(base: type[HTTPConnection], allowed: tuple[Network, ...]) -> type[HTTPConnection]:
    class GuardedConnection(base):  # type: ignore[misc, valid-type]
        def _new_conn(self) -> socket.socket:
            """Resolves the host, keeps only allowed addresses, connects to one of them.
            TLS still verifies the certificate against the host name (self.host)."""
            try:
                infos = socket.getaddrinfo(self._dns_host, self.port, type=socket.SOCK_STREAM)
            except socket.gaierror as error:
                raise _unresolved(error) from None
            usable = [
                info for info in infos if not is_blocked(ipaddress.ip_address(info[4][0]), allowed)
            ]
            if not usable:
                raise BlockedAddress("blocked address")
            family, kind, protocol, _, address = usable[0]
            sock = socket.socket(family, kind, protocol)
            try:
                sock.settimeout(self.timeout)
                sock.connect(address)
            except OSError:
                sock.close()
                raise
            return sock

    return GuardedConnection


def _unresolved(error: socket.gaierror) -> FetchFailed:
    return FetchFailed("dns timeout" if error.errno == socket.EAI_AGAIN else "host not found")


class Fetcher:
    """One per worker process, shared by its threads (urllib3's pools are thread-safe)."""

    def __init__(self, settings: DownloadSettings) -> None:
        self.settings = settings
        allowed = tuple(
            ipaddress.ip_network(cidr, strict=False) for cidr in settings.allow_networks
        )
        self.manager = urllib3.PoolManager(
            num_pools=256,
            maxsize=4,
            headers={"User-Agent": USER_AGENT},
            timeout=urllib3.Timeout(connect=settings.connect_timeout, read=settings.read_timeout),
            retries=False,
        )
        self.manager.pool_classes_by_scheme = {
            "http": type(
                "GuardedHTTPPool",
                (HTTPConnectionPool,),
                {"ConnectionCls": _guarded(HTTPConnection, allowed)},
            ),
            "https": type(
                "GuardedHTTPSPool",
                (HTTPSConnectionPool,),
                {"ConnectionCls": _guarded(HTTPSConnection, allowed)},
            ),
        }

    def fetch(self, url: str) -> Fetched:
        """The image's bytes; transient failures are tried again after a pause. A server
        that asks for a longer pause than sdq waits gets no retry now; `--retry-failed`
        asks again later."""
        for attempt in range(self.settings.retries + 1):
            try:
                return self._follow(url)
            except FetchFailed as failure:
                pause = failure.pause(attempt)
                last = attempt == self.settings.retries
                if not failure.transient or last or pause > MAX_RETRY_AFTER:
                    raise
                time.sleep(pause)
        raise AssertionError("unreachable")

    def _follow(self, url: str) -> Fetched:
        for _ in range(self.settings.max_redirects + 1):
            _check_scheme(url)
            response = self._request(url)
            try:
                if response.status not in REDIRECTS:
                    data = self._body(response)
                    # Read to the end: the connection can serve the next image.
                    response.release_conn()
                    return Fetched(data, url)
                location = response.headers.get("Location")
                if not location:
                    raise FetchFailed(f"http {response.status} without a location")
                url = urljoin(url, location)
            finally:
                # Anything left unread (a redirect's body, a refused image) is not worth
                # reading: the connection goes, not back to the pool.
                response.close()
        raise FetchFailed("too many redirects")

    def _request(self, url: str) -> urllib3.BaseHTTPResponse:
        try:
            return self.manager.request(
                "GET", url, preload_content=False, redirect=False, decode_content=True
            )
        except BlockedAddress as error:
            raise FetchFailed(str(error)) from None
        except (HTTPError, OSError) as error:
            raise _network_failure(error) from None

    def _body(self, response: urllib3.BaseHTTPResponse) -> bytes:
        status = response.status
        if status == 429 or status >= 500:
            wait = _retry_after(response.headers.get("Retry-After"))
            raise FetchFailed(f"http {status}", retry_after=wait)
        if status != 200:
            raise FetchFailed(f"http {status}")
        if _opted_out(response.headers.getlist("X-Robots-Tag")):
            raise FetchFailed("opted out")
        length = response.headers.get("Content-Length")
        if length and length.isdigit() and int(length) > self.settings.max_bytes:
            raise FetchFailed("too large")
        return self._read_capped(response)

    def _read_capped(self, response: urllib3.BaseHTTPResponse) -> bytes:
        """Reads at most max_bytes, within read_timeout in all: a server that sends a byte
        a second would otherwise never trip the per-read timeout."""
        deadline = time.monotonic() + self.settings.read_timeout
        chunks: list[bytes] = []
        size = 0
        try:
            while chunk := response.read1(READ_CHUNK):
                size += len(chunk)
                if size > self.settings.max_bytes:
                    raise FetchFailed("too large")
                if time.monotonic() > deadline:
                    raise FetchFailed("timeout")
                chunks.append(chunk)
        except (HTTPError, OSError) as error:
            raise _network_failure(error) from None
        return b"".join(chunks)


def _check_scheme(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchFailed("not an http(s) url")


def _opted_out(values: list[str]) -> bool:
    """`X-Robots-Tag: noai`, `noimageai`, or the same for any named agent (`bot: noai`)."""
    for value in values:
        for directive in value.split(","):
            token = directive.split(":")[-1].strip().lower()
            if token in OPT_OUT_TOKENS:
                return True
    return False


def _network_failure(error: BaseException) -> FetchFailed:
    if isinstance(error, TimeoutError | socket.timeout):
        return FetchFailed("timeout")
    if isinstance(error, ProtocolError | ConnectionError):
        return FetchFailed("connection failed")
    return FetchFailed(f"connection failed: {type(error).__name__}")


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds or as an HTTP date, as seconds from now; None when absent
    or unreadable."""
    if not value:
        return None
    if value.strip().isdigit():
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = (when - datetime.now(UTC)).total_seconds()
    return max(0.0, seconds)

"""Fetching one image from a URL someone else wrote: only http(s), never to a private,
local or metadata address, within byte, time and redirect caps, and honouring opt-outs.

One deadline covers a whole fetch, redirects, headers and body included: a server that
trickles its headers a byte at a time, each within the socket's read timeout, is cut off
when the deadline comes, like one that trickles its body.

The address check runs where the socket connects (urllib3's `_new_conn`), on the very
addresses the connection then uses, for the first URL and for every redirect target: a
name that resolves to a public address when checked and a private one when used (DNS
rebinding) cannot slip between the two.
"""

import contextlib
import email.utils
import ipaddress
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urljoin, urlsplit

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import HTTPError, ProtocolError, TimeoutError

from sdq.models.datasets import BLOCKED_ADDRESS, is_transient
from sdq.models.download.settings import DownloadSettings

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


class Deadline:
    """When one fetch must be over. Whichever socket the fetch waits on when the time
    comes is shut down under it, so the blocked read returns at once."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> "Deadline":
        _fetching.deadline = self
        self._timer.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._timer.cancel()
        _fetching.deadline = None

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._socket = sock
            if self.expired:
                _hang_up(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            if self._socket is not None:
                _hang_up(self._socket)


# The deadline of the fetch each thread is making, for the connection it uses.
_fetching = threading.local()


def _watch(sock: socket.socket | None) -> None:
    deadline: Deadline | None = getattr(_fetching, "deadline", None)
    if deadline is not None and sock is not None:
        deadline.watch(sock)


def _hang_up(sock: socket.socket) -> None:
    # The plain socket's shutdown, also under TLS: SSLSocket's own drops its TLS state,
    # which the reading thread is using. A socket closed already needs nothing.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _guarded(base: type[HTTPConnection], allowed: tuple[Network, ...]) -> type[HTTPConnection]:
    class GuardedConnection(base):  # type: ignore[misc, valid-type]
        def getresponse(self, *args: Any, **kwargs: Any) -> Any:
            """The response's headers and body are read on this socket, by its deadline;
            a connection from the pool is watched anew for each fetch."""
            _watch(self.sock)
            return super().getresponse(*args, **kwargs)

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
                raise BlockedAddress(BLOCKED_ADDRESS)
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
        """The image at the end of the redirects, within one deadline for all of it."""
        with Deadline(self.settings.read_timeout) as deadline:
            try:
                fetched = self._redirects(url)
            except FetchFailed:
                if not deadline.expired:
                    raise
            if deadline.expired:  # cut off: whatever the cut-off read raised or returned
                raise FetchFailed("timeout")
            return fetched

    def _redirects(self, url: str) -> Fetched:
        for _ in range(self.settings.max_redirects + 1):
            _check_url(url)
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
                url = _joined(url, location)
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
        """Reads at most max_bytes, counted as they come: a missing or lying
        Content-Length does not lift the cap."""
        chunks: list[bytes] = []
        size = 0
        try:
            while chunk := response.read1(READ_CHUNK):
                size += len(chunk)
                if size > self.settings.max_bytes:
                    raise FetchFailed("too large")
                chunks.append(chunk)
        except (HTTPError, OSError) as error:
            raise _network_failure(error) from None
        return b"".join(chunks)


def _check_url(url: str) -> None:
    """An http(s) URL whose host can be looked up: a host that is not a valid name (a
    label over 63 characters, an empty label) makes the resolver raise, not refuse."""
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port
    except ValueError:  # an unclosed [IPv6 literal, a port that is not a number
        raise FetchFailed("invalid url") from None
    if parts.scheme not in ("http", "https") or not host:
        raise FetchFailed("not an http(s) url")
    try:
        host.encode("idna")
    except UnicodeError:
        raise FetchFailed("invalid url") from None


def _joined(url: str, location: str) -> str:
    try:
        return urljoin(url, location)
    except ValueError:
        raise FetchFailed("invalid url") from None


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

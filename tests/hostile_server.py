"""An HTTP server on loopback that serves what the web serves a downloader: good images of
many kinds and every hostile answer sdq must survive. Each path names its case."""

import functools
import io
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import numpy as np
from PIL import Image

SLOW_SECONDS = 4  # longer than the tests' read timeout


def jpeg(width: int, height: int, seed: int = 0, **save) -> bytes:
    """A photo-like JPEG: smooth gradients plus noise, so resizing has something to keep."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "JPEG", quality=90, **save)
    return buffer.getvalue()


def _saved(image: Image.Image, image_format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, image_format, **options)
    return buffer.getvalue()


def exif_rotated() -> bytes:
    """Stored 200 wide and 100 high, tagged to be shown turned a quarter (orientation 6)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return jpeg(200, 100, exif=exif.tobytes())


def palette_with_alpha() -> bytes:
    """A palette PNG whose index 0 is fully transparent: it must come out white."""
    image = Image.new("P", (120, 120), 0)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    image.paste(1, (60, 0, 120, 120))
    return _saved(image, "PNG", transparency=0)


def cmyk() -> bytes:
    return _saved(Image.new("CMYK", (120, 120), (0, 255, 255, 0)), "JPEG")  # pure red


def sixteen_bit() -> bytes:
    gradient = np.tile(np.linspace(0, 65535, 128, dtype=np.uint16), (128, 1))
    return _saved(Image.fromarray(gradient), "PNG")


def bomb(side: int = 12_000) -> bytes:
    """A tiny file that claims side x side pixels: 1-bit PNG of zeros compresses to bytes."""
    return _saved(Image.new("1", (side, side)), "PNG")


@functools.cache
def many_pixels(megapixels: int = 80) -> bytes:
    """A PNG of `megapixels` million pixels in a few hundred kB: a smooth picture compresses
    well, and decodes to three bytes a pixel all the same."""
    width = 10_000
    height = megapixels * 1_000_000 // width
    rows = np.linspace(0, 255, height, dtype=np.uint8)[:, None, None]
    image = Image.fromarray(np.broadcast_to(rows, (height, width, 3)).copy(), "RGB")
    return _saved(image, "PNG", compress_level=1)


FIXED: dict[str, tuple[str, bytes]] = {}


def _fixed() -> dict[str, tuple[str, bytes]]:
    if not FIXED:
        photo = jpeg(640, 480, seed=1)
        FIXED.update(
            {
                "/photo.jpg": ("image/jpeg", photo),
                "/same-photo-elsewhere.jpg": ("image/jpeg", photo),
                "/wide.jpg": ("image/jpeg", jpeg(1600, 900, seed=2)),
                "/exif-rotated.jpg": ("image/jpeg", exif_rotated()),
                "/palette-alpha.png": ("image/png", palette_with_alpha()),
                "/cmyk.jpg": ("image/jpeg", cmyk()),
                "/16bit.png": ("image/png", sixteen_bit()),
                "/tiny.jpg": ("image/jpeg", jpeg(20, 20)),
                "/not-an-image.jpg": ("text/html", b"<html>hello</html>"),
                "/truncated.jpg": ("image/jpeg", jpeg(640, 480, seed=3)[:4000]),
                # Reading a PNG's EXIF decodes all of it: the cut shows there first.
                "/truncated.png": (
                    "image/png",
                    _saved(Image.open(io.BytesIO(jpeg(640, 480, seed=8))), "PNG")[:20_000],
                ),
                "/bomb.png": ("image/png", bomb()),
                "/huge.jpg": ("image/jpeg", jpeg(640, 480, seed=4) + b"\0" * 600_000),
            }
        )
    return FIXED


class Handler(BaseHTTPRequestHandler):
    hits: ClassVar[Counter] = Counter()
    protocol_version = "HTTP/1.1"

    def log_message(self, *_args) -> None:  # quiet: the test reads results, not logs
        pass

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        self.hits[path] += 1
        if path in _fixed():
            self._send(200, *_fixed()[path])
        elif path.startswith("/img/"):  # /img/<n>.jpg: a distinct picture for each n
            n = int(path.removeprefix("/img/").removesuffix(".jpg"))
            self._send(200, "image/jpeg", jpeg(320 + 8 * n, 240, seed=100 + n))
        elif path.startswith("/sized/"):  # /sized/<w>x<h>/<n>.jpg: a picture of that size
            size, name = path.removeprefix("/sized/").split("/")
            width, height = map(int, size.split("x"))
            self._send(200, "image/jpeg", jpeg(width, height, seed=200 + int(name[:-4])))
        elif path.startswith("/many-pixels/"):  # /many-pixels/<n>.png: one each, alike
            self._send(200, "image/png", many_pixels())
        elif path == "/huge-unsized.jpg":
            self._send_chunked(_fixed()["/huge.jpg"][1])
        elif path == "/noai.jpg":
            self._send(200, "image/jpeg", _fixed()["/photo.jpg"][1], {"X-Robots-Tag": "noai"})
        elif path == "/flaky.jpg":  # 500 the first time, then the image
            if self.hits[path] == 1:
                self._send(500, "text/plain", b"try again")
            else:
                self._send(200, "image/jpeg", jpeg(300, 300, seed=5))
        elif path == "/busy.jpg":
            self._send(429, "text/plain", b"slow down")
        elif path == "/recovering.jpg":  # 503 the first two times: past one retry
            if self.hits[path] <= 2:
                self._send(503, "text/plain", b"down for maintenance")
            else:
                self._send(200, "image/jpeg", jpeg(300, 300, seed=6))
        elif path.startswith("/down-for/"):  # /down-for/<n>.jpg: 503 the first n times
            if self.hits[path] <= int(path.removeprefix("/down-for/").removesuffix(".jpg")):
                self._send(503, "text/plain", b"down for maintenance")
            else:
                self._send(200, "image/jpeg", jpeg(300, 300, seed=8))
        elif path.startswith("/retry-after/"):  # 429 "come back in N s" once, then the image
            if self.hits[path] == 1:
                wait = path.removeprefix("/retry-after/").removesuffix(".jpg")
                self._send(429, "text/plain", b"later", {"Retry-After": wait})
            else:
                self._send(200, "image/jpeg", jpeg(300, 300, seed=7))
        elif path == "/slow.jpg":
            self._send_slowly(_fixed()["/photo.jpg"][1])
        elif path == "/slow-headers.jpg":
            self._send_headers_slowly(_fixed()["/photo.jpg"][1])
        elif path == "/loop":
            self._redirect("/loop")
        elif path.startswith("/redirect"):
            self._redirect(self.path.split("?to=", 1)[1])
        else:
            self._send(404, "text/plain", b"not found")

    def _send(self, status: int, kind: str, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _send_chunked(self, body: bytes) -> None:
        """No Content-Length: only counting the bytes as they come can enforce the cap."""
        self.send_response(200)
        self.send_header("Content-Type", "image/jpeg")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for start in range(0, len(body), 65536):
            chunk = body[start : start + 65536]
            self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def _send_slowly(self, body: bytes) -> None:
        """A byte now and then: each read returns in time, the whole never does."""
        self.send_response(200)
        self.send_header("Content-Type", "image/jpeg")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        deadline = time.monotonic() + SLOW_SECONDS
        for byte in body:
            if time.monotonic() > deadline:
                break
            try:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.2)

    def _send_headers_slowly(self, body: bytes) -> None:
        """The status line and headers a byte at a time, each within the read timeout, for
        longer than the whole timeout; then the image at once."""
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: image/jpeg\r\nX-Padding: {'.' * 40}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        pause = SLOW_SECONDS / len(head)
        try:
            for byte in head:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(pause)
            self.wfile.write(body)
        except OSError:
            return

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    # A worker opens dozens of connections at once; the default backlog of 5 would turn
    # some into resets that the cases do not expect.
    request_queue_size = 256

    def handle_error(self, request, client_address) -> None:
        """Clients hanging up mid-answer (a refused bomb, a timed-out trickle) are the point."""


class HostileServer:
    def __init__(self, host: str = "127.0.0.1") -> None:
        _fixed()  # made before serving: the first requests must not wait for them
        # Hit counts of its own: a second server in the process starts its flaky path afresh.
        handler = type("Handler", (Handler,), {"hits": Counter()})
        self.server = QuietServer((host, 0), handler)
        self.port = self.server.server_address[1]
        self.base = f"http://{host}:{self.port}"

    def __enter__(self) -> "HostileServer":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_exc) -> None:
        self.server.shutdown()
        self.server.server_close()


# Every case, with the status and reason its row must end with. `{base}` is the server,
# `{port}` its port; 127.0.0.2 is loopback too, but not on the allowed list.
CASES = [
    ("/photo.jpg", "success", None),
    ("/wide.jpg", "success", None),
    ("/exif-rotated.jpg", "success", None),
    ("/palette-alpha.png", "success", None),
    ("/cmyk.jpg", "success", None),
    ("/16bit.png", "success", None),
    ("/flaky.jpg", "success", None),
    ("/photo.jpg", "duplicate", "duplicate of {photo}"),
    ("/same-photo-elsewhere.jpg", "duplicate", "duplicate of {photo}"),
    ("/tiny.jpg", "failed", "image too small"),
    ("/not-an-image.jpg", "failed", "not an image"),
    ("/truncated.jpg", "failed", "truncated image"),
    ("/truncated.png", "failed", "truncated image"),
    ("/bomb.png", "failed", "decompression bomb"),
    ("/huge.jpg", "failed", "too large"),
    ("/huge-unsized.jpg", "failed", "too large"),
    ("/slow.jpg", "failed", "timeout"),
    ("/slow-headers.jpg", "failed", "timeout"),
    ("/missing.jpg", "failed", "http 404"),
    ("/busy.jpg", "failed", "http 429"),
    ("/loop", "failed", "too many redirects"),
    ("/noai.jpg", "failed", "opted out"),
    ("/redirect?to=http://127.0.0.2:{port}/photo.jpg", "failed", "blocked address"),
    ("http://[::ffff:127.0.0.2]:{port}/photo.jpg", "failed", "blocked address"),
    ("/redirect?to=file:///etc/passwd", "failed", "not an http(s) url"),
    ("http://[::1", "failed", "invalid url"),
    ("/redirect?to=http://[::1", "failed", "invalid url"),
    ("http://{label}.example/photo.jpg", "failed", "invalid url"),
    ("/photo.jpg?empty-caption", "failed", "empty caption"),
]
# Only inside a network namespace with nothing but loopback: if the refusal were broken,
# these would try to reach the real thing.
OFF_MACHINE_CASES = [
    ("/redirect?to=http://169.254.169.254/latest/meta-data/", "failed", "blocked address"),
    ("http://169.254.169.254/latest/meta-data/", "failed", "blocked address"),
    ("http://10.0.0.1/private.jpg", "failed", "blocked address"),
]


def case_rows(base: str, port: int, cases: list[tuple[str, str, str | None]]) -> list[dict]:
    rows = []
    for index, (path, status, reason) in enumerate(cases):
        url = (path if path.startswith("http") else base + path).format(port=port, label="a" * 64)
        caption = "" if path.endswith("?empty-caption") else f"case {index}: {path}"
        rows.append({"url": url, "caption": caption, "status": status, "reason": reason})
    return rows

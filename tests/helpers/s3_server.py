"""A real S3 protocol server on localhost for the object-storage tests: moto's server mode
(the HTTP server ``ThreadedMotoServer`` runs, ``moto.server.DomainDispatcherApplication``),
reached over HTTP through ``s3fs`` the way s3fs's own test suite runs, on a free port, no
network. A small WSGI layer in front of it injects the faults a real store produces, so the
client code under test meets them as HTTP responses, not as mocks:

* ``faults.slow_down(n, method=..., path_contains=...)``: the next ``n`` matching requests get
  ``503 SlowDown`` (S3's throttling answer);
* ``faults.bad_keys``: requests signed with one of these access key ids get
  ``403 InvalidAccessKeyId`` (moto itself accepts any key).

``S3Server.env()`` is the environment a subprocess needs to reach it (``AWS_ENDPOINT_URL``,
dummy keys, no instance-metadata lookups)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from dataclasses import dataclass, field

DUMMY_KEY, DUMMY_SECRET = "testing", "testing"


@dataclass
class Faults:
    slowdowns: list = field(default_factory=list)  # [remaining, method, path_contains]
    bad_keys: set = field(default_factory=set)
    served: dict = field(default_factory=lambda: {"slow_down": 0, "bad_key": 0})
    requests: list = field(default_factory=list)  # (method, path) of every request, in order
    lock: threading.Lock = field(default_factory=threading.Lock)

    def slow_down(self, n: int, *, method: str | None = None, path_contains: str = "") -> None:
        with self.lock:
            self.slowdowns.append([int(n), method, path_contains])

    def clear(self) -> None:
        with self.lock:
            self.slowdowns.clear()
            self.bad_keys.clear()
            self.served.update(slow_down=0, bad_key=0)
            self.requests.clear()

    def pick(self, environ) -> tuple[str, bytes] | None:
        auth = environ.get("HTTP_AUTHORIZATION", "")
        with self.lock:
            self.requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")))
            for key in self.bad_keys:
                if f"Credential={key}/" in auth:
                    self.served["bad_key"] += 1
                    return "403 Forbidden", _error("InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records.")
            path = environ.get("PATH_INFO", "")
            for rule in self.slowdowns:
                if rule[0] > 0 and (rule[1] is None or rule[1] == environ["REQUEST_METHOD"]) and rule[2] in path:
                    rule[0] -= 1
                    self.served["slow_down"] += 1
                    return "503 Slow Down", _error("SlowDown", "Please reduce your request rate.")
        return None


def _error(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
            "<RequestId>stacklm-test</RequestId></Error>").encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 server on ``127.0.0.1:<free port>`` behind the fault layer; ``start``/``stop``."""

    def __init__(self) -> None:
        self.faults = Faults()
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None
        self._thread = None

    def start(self) -> "S3Server":
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        moto_app = DomainDispatcherApplication(create_backend_app)
        faults = self.faults

        def app(environ, start_response):
            hit = faults.pick(environ)
            if hit is not None:
                status, body = hit
                start_response(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
                return [] if environ["REQUEST_METHOD"] == "HEAD" else [body]  # a HEAD answer has no body
            return moto_app(environ, start_response)

        import logging

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self._server = make_server("127.0.0.1", self.port, app, threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._thread.join(10)
            self._server = None

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": DUMMY_KEY, "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull}

    def filesystem(self, **kwargs):
        import s3fs

        return s3fs.S3FileSystem(key=DUMMY_KEY, secret=DUMMY_SECRET, client_kwargs={"endpoint_url": self.endpoint},
                                 skip_instance_cache=True, **kwargs)


def s3_tree(fs, url: str) -> dict[str, bytes]:
    """The objects under ``url`` (``s3://bucket/prefix``) as ``tree`` gives a local folder: path
    below the prefix -> bytes. Listed afresh: ``fs`` caches listings, another client wrote them."""
    prefix = url.split("://", 1)[1].rstrip("/")
    fs.invalidate_cache()
    return {p[len(prefix) + 1:]: fs.cat_file(p) for p in sorted(fs.find(prefix))}


@contextlib.contextmanager
def upload_killed_after(n: int):
    """In the block, ``remote.put_file`` uploads ``n`` files, then raises ``KeyboardInterrupt``
    where the next would start, as a process killed mid-upload stops; yields the URLs uploaded."""
    from stacklm.data.storage import remote

    real, done = remote.put_file, []

    def put_then_die(local, target):
        if len(done) == n:
            raise KeyboardInterrupt("killed mid-upload")
        real(local, target)
        done.append(target)

    remote.put_file = put_then_die
    try:
        yield done
    finally:
        remote.put_file = real

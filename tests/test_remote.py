"""Shard sets in object storage, tested against a real S3 protocol server on this machine
(moto's server mode over HTTP through s3fs, ``tests/s3_server.py``); no network."""

from __future__ import annotations

import pytest


def test_s3_server_round_trip_and_injected_slowdown(s3_bucket, s3_server):
    """The harness itself: objects go over HTTP to moto and back; an injected SlowDown is a
    503 the client sees (s3fs retries it) and is counted."""
    fs, bucket = s3_bucket
    fs.pipe(f"{bucket}/a/b.bin", b"hello")
    assert fs.cat(f"{bucket}/a/b.bin") == b"hello"
    s3_server.faults.slow_down(2, method="GET", path_contains="/a/b.bin")
    assert fs.cat(f"{bucket}/a/b.bin") == b"hello"
    assert s3_server.faults.served["slow_down"] == 2

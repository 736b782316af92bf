"""Real Redis servers for the tier's tests, and a tiny random-weight model.

`TFREDIS_TEST_URLS` (comma-separated, set by `.ci/run`, which starts the
servers) names shared instances; otherwise the session starts its own
`redis-server` processes. Tests that stop, restart or stall Redis always get
their own server.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from tokenflow.testing import build_tiny_model

torch.set_num_threads(2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One `redis-server` process on 127.0.0.1, in memory only; stop, start again, stall."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server; .ci/run does)")
        self.binary = binary
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    if server.process is not None:
        server.resume()
    server.stop()


@pytest.fixture(scope="session")
def shared_redis_urls() -> Iterator[list[str]]:
    from_ci = os.environ.get("TFREDIS_TEST_URLS", "").strip()
    if from_ci:
        yield [u.strip() for u in from_ci.split(",") if u.strip()]
        return
    servers = [RedisServer() for _ in range(3)]
    for server in servers:
        server.start()
    yield [s.url for s in servers]
    for server in servers:
        server.stop()


@pytest.fixture
def redis_urls(shared_redis_urls: list[str]) -> list[str]:
    """The shared instances, emptied for this test."""
    for url in shared_redis_urls:
        client = redis.Redis.from_url(url)
        client.flushdb()
        client.close()
    return shared_redis_urls


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(autouse=True)
def _fp32_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests compare tokens exactly with and without the tier, in batches of different shapes:
    fp32 keeps greedy tokens equal across batch shapes, bf16 (dtype="auto" on CPUs with native bf16)
    does not."""
    monkeypatch.setenv("TOKENFLOW_DTYPE", "float32")

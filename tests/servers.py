"""HTTP servers for tests: the OpenAI app under uvicorn in a thread (its engine inspectable), or a real
`tokenflow serve` process on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tokenflow.serve.openai_app import create_app

__all__ = ("ServeProcess", "Server", "free_port", "metric_values")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen[bytes] | None = None, limit_s: float = 90.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the server did not become healthy")


class Server:
    """uvicorn in a background thread (its own event loop owns the engine)."""

    def __init__(self, model: Any, **settings: Any) -> None:
        self.port = free_port()
        self.app = create_app(str(model), **settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self.thread.start()
        _wait_healthy(self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def stats(self) -> dict[str, Any]:
        return self.app.state.engine.stats()

    def openai_client(self) -> Any:
        """The official client on this server's /v1, no retries (a refusal must surface as is)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)


class ServeProcess:
    """`python -m tokenflow serve ARGS...` on a free port, its output in a log file."""

    def __init__(self, model: Any, *args: str, env: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.port = free_port()
        self.argv = [sys.executable, "-m", "tokenflow", "serve", "--model", str(model), "--port", str(self.port),
                     *args]
        self.env = {**os.environ, **(env or {})}
        self.log_path = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def __enter__(self) -> ServeProcess:
        self._log = open(self.log_path, "wb") if self.log_path else None  # closed in __exit__
        out = self._log or subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        try:
            _wait_healthy(self.url, self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown closes the engine
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()


def metric_values(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Every sample of `/metrics`, keyed `name` or `name{label=value,...}`."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values

"""Run one benchmark workload on llama.cpp's `llama-server` (`tokenflow bench --peers llamacpp` starts this).

    python tokenflow/benchmarks/peer_llamacpp.py --server .peers/llamacpp/bin/llama-server --gguf m.gguf \
        --workload w.json --max-num-seqs 16

Starts `llama-server` on 127.0.0.1 with one slot per client (continuous batching, both cores, the prompt cache
on as the server's default), sends token-id prompts to `/completion` (greedy, EOS ignored, streamed), through
the same client code (`clients.py`, next to this file) as tokenflow's own worker; prints one line
`RESULT {json}`. Standard library only, like `clients.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from clients import run_workload

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _start_server(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [args.server, "-m", args.gguf, "--host", HOST, "--port", str(port), "-np", str(args.max_num_seqs),
           "-c", str(args.max_num_seqs * args.slot_context), "-t", str(os.cpu_count() or 1), "--no-webui"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(args.log, "wb"))


def _wait_ready(proc: subprocess.Popen[bytes], port: int, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}: see its log")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise SystemExit("llama-server did not become ready")


async def _events(port: int, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The server-sent events of one streamed POST /completion (HTTP/1.1, chunked transfer encoding)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    payload = json.dumps(body).encode()
    writer.write(b"POST /completion HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (HOST.encode(), len(payload)) + payload)
    await writer.drain()
    try:
        status = await reader.readline()
        if not re.match(rb"HTTP/1\.[01] 200", status):
            raise RuntimeError(f"llama-server answered {status!r}")
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            chunked |= line.lower().replace(b" ", b"").startswith(b"transfer-encoding:chunked")
        buffer = b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    break
                buffer += await reader.readexactly(size)
                await reader.readexactly(2)  # the chunk's CRLF
            else:
                data = await reader.read(65536)
                if not data:
                    break
                buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.splitlines():
                    if line.startswith(b"data: "):
                        yield json.loads(line[6:])
    finally:
        writer.close()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    workload = json.loads(Path(args.workload).read_text())
    port = _free_port()
    started = time.perf_counter()
    proc = _start_server(args, port)
    try:
        await asyncio.to_thread(_wait_ready, proc, port)
        load_s = time.perf_counter() - started

        async def stream(ids: list[int], max_tokens: int) -> AsyncIterator[list[int]]:
            body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "return_tokens": True, "cache_prompt": True}
            async for event in _events(port, body):
                tokens = event.get("tokens") or []
                if tokens:
                    yield list(tokens)
                if event.get("stop"):
                    return

        async for _ in stream(workload["warmup"], 4):
            pass
        result = await run_workload(stream, workload)
        rss_kb = _rss_kb(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {**result, "engine": "llamacpp", "version": _version(args.server), "load_s": round(load_s, 2),
            "peak_rss_mb": round(rss_kb / 1024, 1), "gguf": Path(args.gguf).name}


def _rss_kb(pid: int) -> int:
    """The server's peak resident memory (VmHWM), in KiB; 0 where /proc does not say."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(found.group(1)) if found else 0


def _version(server: str) -> str:
    out = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=30)
    found = re.search(r"version: (.+)", out.stdout + out.stderr)
    return found.group(1).strip() if found else "unknown"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--server", required=True, help="the llama-server binary")
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--slot-context", type=int, default=4096, help="tokens of context per slot")
    parser.add_argument("--log", default=os.devnull, help="where the server's log goes")
    result = asyncio.run(main(parser.parse_args()))
    print("RESULT " + json.dumps(result), flush=True)

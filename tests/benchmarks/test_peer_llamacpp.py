"""The llama-server driver's stream reader: server-sent events over chunked HTTP, split anywhere."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tokenflow.benchmarks.peer_llamacpp import HOST, _events


class _Streamer(BaseHTTPRequestHandler):
    """Answers POST /completion as llama-server streams: one `data:` event per token, in HTTP chunks cut at
    awkward places (inside an event, between its two newlines)."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        events = b"".join(b"data: " + json.dumps({"tokens": [t], "stop": False}).encode() + b"\n\n"
                          for t in body["prompt"])
        events += b"data: " + json.dumps({"tokens": [], "stop": True}).encode() + b"\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for start in range(0, len(events), 7):
            piece = events[start:start + 7]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass


async def test_events_reassemble_chunks_into_whole_events() -> None:
    server = ThreadingHTTPServer((HOST, 0), _Streamer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        prompt = list(range(100, 160))
        events = [e async for e in _events(server.server_address[1], {"prompt": prompt})]
    finally:
        server.shutdown()
    assert [t for e in events for t in e["tokens"]] == prompt
    assert [e["stop"] for e in events] == [False] * len(prompt) + [True]

"""A third-party request stage: replaces e-mail addresses in prompts and chat
messages with `[email]` before tokenization.

It uses nothing from tokenflow but the public request-stage contract: an
object with `async def handle(request, call_next)`. Enable it with
`Engine(..., request_stages=["redact"])`: the engine runs its middleware after admission and before the
response cache and tokenizing.
"""

from __future__ import annotations

import re
from typing import Any

EMAIL = re.compile(r"[\w.+-]+@[\w-]+(\.[\w-]+)+")
REPLACEMENT = "[email]"


class RedactEmails:
    def __init__(self, config: Any) -> None:
        self.num_redacted = 0

    def _redact(self, text: str) -> str:
        text, count = EMAIL.subn(REPLACEMENT, text)
        self.num_redacted += count
        return text

    async def handle(self, request: Any, call_next: Any) -> None:
        if isinstance(request.prompt, str):
            request.prompt = self._redact(request.prompt)
        if request.messages is not None:
            request.messages = [{**m, "content": self._redact(m["content"])} for m in request.messages]
        await call_next(request)

    def stats(self) -> dict[str, int]:
        return {"redacted_emails": self.num_redacted}


def create(config: Any) -> RedactEmails:
    return RedactEmails(config)

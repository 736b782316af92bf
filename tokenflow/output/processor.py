"""Turns sampled tokens into text chunks and decides when a request is done.

Runs on the event loop after every step (and is cheap per token): an
incremental detokenizer per request, a stop-string matcher that holds back
text that may start a stop string, and the stop / length checks. The text a
request returns is by construction the concatenation of its chunks.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from tokenflow.output.detokenizer import IncrementalDetokenizer
from tokenflow.output.stops import StopStringMatcher
from tokenflow.params import Chunk, TokenLogprob, Usage
from tokenflow.request import Request

__all__ = ("OutputProcessor",)


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._failed: dict[Request, Exception] = {}  # requests to fail after this step (`take_failures`)

    def prepare(self, request: Request) -> None:
        """Attach the per-request detokenizer and stop matcher before it runs."""
        params = request.params
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids=request.prompt_token_ids or (),
            skip_special_tokens=params.skip_special_tokens,
        )
        request.stop_matcher = (
            StopStringMatcher(params.stop, include_stop=params.include_stop_str_in_output) if params.stop else None
        )

    def append(self, request: Request, token_id: int, logprob: TokenLogprob | None) -> bool:
        """Record one sampled token; emit its chunk. Returns True when the request finished."""
        params = request.params
        request.output_token_ids.append(token_id)
        if logprob is not None:
            request.output_logprobs.append(logprob)
        first = request.first_token_time is None
        if first:
            request.first_token_time = time.monotonic()
        num_out = len(request.output_token_ids)

        finish: str | None = None
        text = ""
        constraint = request.constraint
        if constraint is not None:  # the grammar moves on; once it has nothing left to match, the output is done
            if request in self._failed:
                return False
            if not constraint.consume_token(token_id):  # the grammar engine gave up (e.g. one of its limits)
                self._failed[request] = _constraint_failure(request, constraint)
                return False
            if constraint.is_stopped():
                finish = "stop"
        if num_out > params.min_tokens and (
            token_id in request.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos)
        ):
            finish = "stop"
            request.stop_reason = token_id if token_id in request.stop_token_ids else None
        else:
            assert request.detokenizer is not None
            text = request.detokenizer.push(token_id)  # a grammar's final token still has its text
            stops = request.stop_matcher
            if stops is not None:
                text, matched = stops.feed(text)
                if matched is not None:
                    finish = "stop"
                    request.stop_reason = matched
        if finish is None and (num_out >= request.max_tokens or request.num_tokens >= self.max_model_len):
            finish = "length"
        if finish is not None:
            tail, matched = self._flush(request, stopped_by_string=isinstance(request.stop_reason, str))
            text += tail
            if matched is not None:
                finish, request.stop_reason = "stop", matched
        self._emit(request, text, [token_id], logprob, finish, first=first)
        return finish is not None

    def take_failures(self) -> list[tuple[Request, Exception]]:
        """Requests whose output constraint could not take their token in the last step: the step loop
        fails them (they would otherwise end as a plausible "stop" on output the constraint never checked)."""
        failed, self._failed = list(self._failed.items()), {}
        return failed

    def finish_length(self, request: Request) -> None:
        """End a request whose backend stopped at its token budget without a final token."""
        tail, matched = self._flush(request, stopped_by_string=False)
        if matched is not None:
            request.stop_reason = matched
        self._emit(request, tail, [], None, "stop" if matched is not None else "length",
                   first=not request.output_token_ids)

    def finish_aborted(self, request: Request) -> None:
        """End a request that was cancelled or timed out (no flush of held text)."""
        if request.finish_reason is None:
            request.finish_reason = "abort"

    def _flush(self, request: Request, *, stopped_by_string: bool) -> tuple[str, str | None]:
        """Text held back at the end; and the stop string if one completes only in that tail."""
        if stopped_by_string:
            return "", None  # text after a stop string is dropped
        assert request.detokenizer is not None
        tail = request.detokenizer.flush()
        stops = request.stop_matcher
        if stops is None:
            return tail, None
        tail, matched = stops.feed(tail)
        return (tail, matched) if matched is not None else (tail + stops.flush(), None)

    def _emit(
        self, request: Request, text: str, token_ids: list[int], logprob: TokenLogprob | None, finish: str | None,
        *, first: bool = False,
    ) -> None:
        chunk = Chunk(text=text, token_ids=token_ids, logprobs=[logprob] if logprob is not None else None)
        if first and request.params.prompt_logprobs is not None:  # the prompt is scored by its first token
            chunk.prompt_logprobs = list(request.prompt_logprobs)
        if finish is not None:
            request.finish_reason = finish
            chunk.finish_reason = finish  # type: ignore[assignment]
            chunk.stop_reason = request.stop_reason
            chunk.usage = usage_of(request)
        record = request.response_record
        if record is not None:  # the response cache keeps its own copy (the collector merges chunks in place)
            record.append(msgspec.structs.replace(chunk, token_ids=list(chunk.token_ids)))
        request.collector.put(chunk)


def usage_of(request: Request) -> Usage:
    return Usage(
        prompt_tokens=request.num_prompt_tokens, completion_tokens=len(request.output_token_ids),
        cached_tokens=request.num_cached_tokens,
    )


def _constraint_failure(request: Request, constraint: Any) -> Exception:
    from tokenflow.errors import InvalidRequest
    from tokenflow.structured.grammar import constraint_field

    error = constraint.get_error().splitlines()[0] if constraint.is_error() else "the token was refused"
    return InvalidRequest(f"the output constraint could not be enforced after {len(request.output_token_ids) - 1} "
                          f"tokens: {error}", field=constraint_field(request.params))

"""Prefix-affinity routing: requests that start alike go to the same replica.

Each tokenflow engine keeps the KV of prompts it has seen (prefix caching), so
a request whose prompt starts like an earlier one is cheaper on the replica
that served the earlier one. The router turns the start of the prompt into a
routing key and picks a replica for the key by rendezvous hashing.

Rendezvous (highest-random-weight) hashing scores every (key, replica) pair
with a stable hash and takes the highest score. It needs no ring or state,
and when a replica is added only the keys whose new top score belongs to the
new replica move (about 1/(N+1) of them); removing a replica moves only its
own keys. The pure functions below hold the whole policy, so they are tested
without a Ray cluster; `PrefixAffinityRouter` adapts them to Serve's request router API.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

__all__ = ("DEFAULT_MAX_IMBALANCE", "DEFAULT_PREFIX_CHARS", "PrefixAffinityRouter", "prompt_text", "rank_replicas",
           "replica_order", "routing_key")

DEFAULT_PREFIX_CHARS = 256  # roughly 50-100 tokens: a system prompt or a document's opening
DEFAULT_MAX_IMBALANCE = 8  # queued requests beyond the least-loaded replica before affinity gives way


def prompt_text(request: Mapping[str, Any]) -> str:
    """The request's prompt as one string: `prompt` text, token ids, or the chat messages in order.

    Chat messages are joined with their roles so two conversations only share
    a key when they share the rendered start (system prompt, first turns).
    """
    messages = request.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if isinstance(message, Mapping):
                parts.append(f"<{message.get('role', '')}>{_content_text(message.get('content'))}\n")
        return "".join(parts)
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one, as OpenAI clients send it
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(str(token) for token in prompt)  # token ids: equal id prefixes give equal text prefixes
    return ""


def _content_text(content: Any) -> str:
    """A message's text, whether `content` is a string or a list of OpenAI content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return ""


def routing_key(request: Mapping[str, Any], prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str:
    """The first `prefix_chars` characters of the prompt: requests that agree on them share a replica."""
    return prompt_text(request)[:prefix_chars]


def _score(key: str, replica_id: str) -> int:
    """A hash of the pair that is the same in every process (Python's `hash()` is salted per process)."""
    digest = hashlib.blake2b(f"{replica_id}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def replica_order(key: str, replica_ids: Iterable[str]) -> list[str]:
    """Replicas from most to least preferred for `key` (rendezvous hashing)."""
    return sorted(replica_ids, key=lambda replica_id: (_score(key, replica_id), replica_id), reverse=True)


def rank_replicas(
    key: str, replica_ids: Iterable[str], queue_lens: Mapping[str, int | None] | None = None,
    max_imbalance: int = DEFAULT_MAX_IMBALANCE,
) -> list[list[str]]:
    """Ranks for Serve: `[[preferred], [the others]]`, or one rank of all replicas when the preferred
    one is overloaded.

    Serve tries the ranks in order and, within a rank, takes the replica with
    the shortest queue that has room. So a full preferred replica already
    spills to the least-loaded other one; on top of that, a preferred replica
    whose known queue is more than `max_imbalance` longer than the shortest
    known queue loses its turn, because waiting behind a long queue costs more
    than recomputing a prefix. Unknown queue lengths (`None`) never count as
    overload.
    """
    order = replica_order(key, replica_ids)
    if len(order) <= 1:
        return [order] if order else []
    lens = {replica_id: n for replica_id, n in (queue_lens or {}).items() if n is not None and replica_id in order}
    preferred = lens.get(order[0])
    if preferred is not None and preferred - min(lens.values()) > max_imbalance:
        return [order]
    return [order[:1], order[1:]]


class PrefixAffinityRouter(RequestRouter):
    """Serve request router for the tokenflow engine deployment (see the module docs).

    It reads the request the caller passed to the handle (an argument that is
    an OpenAI-style dict with `prompt` or `messages`). Settings come
    from `RequestRouterConfig.request_router_kwargs`: `prefix_chars`,
    `max_imbalance`. A call without a request dict (e.g. `stats()`) gets all
    replicas in one rank, which is Serve's least-loaded choice.
    """

    prefix_chars: int = DEFAULT_PREFIX_CHARS
    max_imbalance: int = DEFAULT_MAX_IMBALANCE

    def initialize_state(self, prefix_chars: int = DEFAULT_PREFIX_CHARS,
                         max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> None:
        self.prefix_chars = prefix_chars
        self.max_imbalance = max_imbalance

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Serve retries the ranks at once, without sleeping, unless told to back off: when every
            # replica is full that would spin the caller's event loop.
            pending_request.routing_context.should_backoff = True
        request = _request_dict(pending_request)
        if request is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        cache = self.replica_queue_len_cache
        queue_lens = {unique_id: cache.get(replica.replica_id) for unique_id, replica in by_id.items()}
        ranks = rank_replicas(routing_key(request, self.prefix_chars), by_id, queue_lens, self.max_imbalance)
        return [[by_id[unique_id] for unique_id in rank] for rank in ranks]


def _request_dict(pending_request: PendingRequest | None) -> Mapping[str, Any] | None:
    """The request dict the caller passed to the handle, if any."""
    if pending_request is None:
        return None
    for arg in [*pending_request.args, *pending_request.kwargs.values()]:
        if isinstance(arg, Mapping) and ("prompt" in arg or "messages" in arg):
            return arg
    return None

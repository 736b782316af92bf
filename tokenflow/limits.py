"""Request limits: every field of a request comes from someone we don't trust.

Checked when a request is built (before any tokenizing, so a 20 MB prompt or
a 100,000-character stop string is refused in microseconds) and, for
`max_tokens`, once the prompt's length is known. Each refusal is an
`InvalidRequest` naming the field; each limit is an `EngineConfig` setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from tokenflow.config import EngineConfig
from tokenflow.errors import InvalidRequest
from tokenflow.params import SamplingParams

__all__ = ("RequestLimits", "longest_token_chars")

# A tokenizer's normaliser may fold several characters into one (e.g. combining accents under NFKC), so the
# derived prompt bound allows this many characters per character a token can spell.
_NORMALISATION_SLACK = 2


def longest_token_chars(tokenizer: Any) -> int:
    """Characters in the longest vocabulary entry: no token spells more text than that."""
    try:
        return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
    except Exception:  # a tokenizer without a vocabulary listing: assume long tokens
        return 64


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    max_prompt_chars: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_stop_token_ids: int
    max_logprobs: int
    max_grammar_chars: int
    max_logit_bias: int
    default_max_tokens: int
    clamp_max_tokens: bool

    @classmethod
    def from_config(cls, config: EngineConfig, max_model_len: int, tokenizer: Any) -> RequestLimits:
        prompt_chars = config.max_prompt_chars or max_model_len * longest_token_chars(tokenizer) * _NORMALISATION_SLACK
        return cls(
            max_model_len=max_model_len, max_prompt_chars=prompt_chars, max_stop_strings=config.max_stop_strings,
            max_stop_string_chars=config.max_stop_string_chars, max_stop_token_ids=config.max_stop_token_ids,
            max_logprobs=config.max_logprobs, max_grammar_chars=config.max_grammar_chars,
            max_logit_bias=config.max_logit_bias,
            default_max_tokens=config.default_max_tokens,
            clamp_max_tokens=config.clamp_max_tokens,
        )

    def check_params(self, params: SamplingParams) -> None:
        if len(params.stop) > self.max_stop_strings:
            raise InvalidRequest(f"at most {self.max_stop_strings} stop strings are allowed, got {len(params.stop)}",
                                 field="stop")
        longest = max((len(s) for s in params.stop), default=0)
        if longest > self.max_stop_string_chars:
            raise InvalidRequest(f"a stop string may have at most {self.max_stop_string_chars} characters, "
                                 f"got {longest}", field="stop")
        if len(params.stop_token_ids) > self.max_stop_token_ids:
            raise InvalidRequest(f"at most {self.max_stop_token_ids} stop token ids are allowed, "
                                 f"got {len(params.stop_token_ids)}", field="stop_token_ids")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise InvalidRequest(f"logprobs may be at most {self.max_logprobs}, got {params.logprobs}",
                                 field="logprobs")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.max_logprobs:
            raise InvalidRequest(f"prompt_logprobs may be at most {self.max_logprobs}, got {params.prompt_logprobs}",
                                 field="prompt_logprobs")
        if params.structured:
            self._check_constraint_size(params)
        if params.logit_bias and len(params.logit_bias) > self.max_logit_bias:
            raise InvalidRequest(f"logit_bias may name at most {self.max_logit_bias} tokens, "
                                 f"got {len(params.logit_bias)}", field="logit_bias")
        if params.max_tokens is not None and params.max_tokens >= self.max_model_len and not self.clamp_max_tokens:
            raise InvalidRequest(self._too_many_tokens(self.max_model_len - 1, params.max_tokens), field="max_tokens")

    def _check_constraint_size(self, params: SamplingParams) -> None:
        for name in ("json_schema", "regex", "grammar", "choice"):
            value = getattr(params, name)
            if value is None:
                continue
            if isinstance(value, str):
                size = len(value)
            elif isinstance(value, list):
                size = sum(len(c) for c in value)
            else:
                try:
                    size = len(msgspec.json.encode(value))
                except (TypeError, msgspec.EncodeError, RecursionError) as exc:
                    raise InvalidRequest(f"`{name}` is not JSON: {exc}", field=name) from None
            if size > self.max_grammar_chars:
                raise InvalidRequest(f"`{name}` has {size} characters; this engine takes at most "
                                     f"{self.max_grammar_chars} (max_grammar_chars)", field=name)

    def check_prompt(self, prompt: Any, messages: Sequence[Any] | None) -> None:
        """Refuse prompts that cannot fit before they are tokenized (types are checked later)."""
        if messages is not None:
            size = _messages_chars(messages)
            if size > self.max_prompt_chars:
                raise InvalidRequest(f"the messages have {size} characters; this engine takes at most "
                                     f"{self.max_prompt_chars} (max_prompt_chars)", field="messages")
        elif isinstance(prompt, str):
            if len(prompt) > self.max_prompt_chars:
                raise InvalidRequest(f"the prompt has {len(prompt)} characters; this engine takes at most "
                                     f"{self.max_prompt_chars} (max_prompt_chars)", field="prompt")
        elif isinstance(prompt, Sequence) and len(prompt) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens; the model allows at most "
                                 f"{self.max_model_len - 1} (max_model_len={self.max_model_len})", field="prompt")

    def max_new_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """The request's token budget: its `max_tokens` (refused or clamped past the context), else the default."""
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            return max(1, min(self.default_max_tokens, room))
        if params.max_tokens > room and not self.clamp_max_tokens:
            raise InvalidRequest(self._too_many_tokens(room, params.max_tokens, num_prompt_tokens), field="max_tokens")
        return max(1, min(params.max_tokens, room))

    def _too_many_tokens(self, room: int, max_tokens: int, num_prompt_tokens: int | None = None) -> str:
        prompt = f"a prompt of {num_prompt_tokens} tokens" if num_prompt_tokens is not None else "the prompt"
        return (f"this model's context is {self.max_model_len} tokens and {prompt} leaves room for at most {room}, "
                f"but max_tokens is {max_tokens}: lower it (or run the engine with clamp_max_tokens=True)")


def _messages_chars(messages: Sequence[Any]) -> int:
    """Characters of the message texts, plus one per message (each renders to at least one token)."""
    total = len(messages)
    for message in messages:
        if isinstance(message, dict):
            total += sum(len(v) for v in message.values() if isinstance(v, str))
            content = message.get("content")
            if isinstance(content, list):
                total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict)
                             and isinstance(p.get("text"), str))
    return total

"""Public data types: sampling parameters in, completions and chunks out.

All are `msgspec.Struct`s: cheap to build, JSON-encodable, and validated when
built through `SamplingParams.from_kwargs` (the path every engine call takes).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec

from tokenflow.errors import InvalidRequest

__all__ = ("STRUCTURED_FIELDS", "Chunk", "Completion", "FinishReason", "SamplingParams", "TokenLogprob", "ToolCall",
           "Usage")

STRUCTURED_FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar")

FinishReason = Literal["stop", "length", "abort"]

_INT32 = 2**31 - 1
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=_INT32)]
Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]  # OpenAI's range


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """How to sample one request, and its per-request scheduling knobs.

    Defaults follow vLLM: temperature 1.0, nucleus and top-k off, no penalties.
    `temperature=0` is greedy. `max_tokens=None` takes the engine's `default_max_tokens`
    (fewer when the context has less room); an explicit value past the context is refused.
    Penalties are bounded so that no value can turn logits into inf or NaN. `priority`: lower is served first.
    `timeout` is seconds from submission; `deadline` an absolute time on the
    `anyio.current_time()` clock; the earlier of the two applies.
    """

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT32)] | None = None
    temperature: NonNegFloat = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=0, le=_INT32)] = 0  # 0 disables top-k
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(ge=0.01, le=100.0)] = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[Annotated[int, msgspec.Meta(ge=0, le=_INT32)]] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=_INT32)] = 0
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=_INT32)] | None = None  # at most the engine's max_logprobs
    # score the prompt: each prompt token's logprob (and this many top alternatives), as vLLM's prompt_logprobs
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=_INT32)] | None = None
    skip_special_tokens: bool = True
    priority: Annotated[int, msgspec.Meta(ge=-_INT32, le=_INT32)] = 0
    timeout: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    deadline: float | None = None
    cache_salt: str | None = None
    lora: str | None = None  # a LoRA adapter the engine serves (`lora_adapters`, `load_lora`); None: the base model
    # chat requests, the template's options (vLLM's): end with the assistant's turn opened (add_generation_prompt),
    # or continue the last message, an assistant's partial answer, without closing it (continue_final_message)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    cache_response: bool | None = None  # None: the engine's `response_cache` setting decides
    logit_bias: dict[TokenId, Bias] | None = None  # token id -> added to its logit before sampling
    # -- structured outputs: at most one; the output is constrained to match it --
    json_schema: dict[str, Any] | str | None = None  # a JSON schema (or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "timeout", "deadline"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise InvalidRequest(f"`{name}` must be a finite number, got {value!r}", field=name)
        if self.logit_bias and not all(math.isfinite(v) for v in self.logit_bias.values()):
            raise InvalidRequest("`logit_bias` values must be finite numbers", field="logit_bias")
        for stop in self.stop:
            if not stop:
                raise InvalidRequest("`stop` strings must be non-empty", field="stop")
            try:
                stop.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest("`stop` strings must be valid Unicode (no lone surrogates)",
                                     field="stop") from None
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidRequest("`seed` must fit in 64 bits", field="seed")
        self._check_constraint()

    def _check_constraint(self) -> None:
        given = [name for name in STRUCTURED_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) > 1:
            raise InvalidRequest(f"`{given[1]}`: at most one output constraint per request, got {', '.join(given)}",
                                 field=given[1])
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise InvalidRequest("`choice` must be a non-empty list of non-empty strings", field="choice")
        for name in ("regex", "grammar", "json_schema", "choice"):
            value = getattr(self, name)
            for text in value if isinstance(value, list) else [value] if isinstance(value, str) else []:
                if not text.strip() and name != "choice":
                    raise InvalidRequest(f"`{name}` must not be empty", field=name)
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise InvalidRequest(f"`{name}` must be valid Unicode (no lone surrogates)", field=name) from None

    @property
    def structured(self) -> bool:
        """Whether the output is constrained by a schema, regex, choice or grammar."""
        return any(getattr(self, name) not in (None, False) for name in STRUCTURED_FIELDS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_kwargs(cls, params: SamplingParams | None = None, **kwargs: Any) -> SamplingParams:
        """Build validated params from keywords (over `params` when given).

        Raises `InvalidRequest` naming the field for an unknown keyword, a wrong
        type or an out-of-range value.
        """
        if params is not None:  # checked again: a Struct built directly skips its constraints
            if not isinstance(params, SamplingParams):
                raise InvalidRequest("`params` must be a tokenflow.SamplingParams", field="params")
            kwargs = {**msgspec.structs.asdict(params), **kwargs}
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = [kwargs["stop"]]
        try:
            return msgspec.convert(kwargs, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"invalid sampling parameter: {exc}", field=_field_of(exc)) from None


def _field_of(exc: msgspec.ValidationError) -> str | None:
    """Pull the field name out of msgspec's message (`... - at `$.top_p``, `unknown field `x``)."""
    text = str(exc)
    for marker in ("at `$.", "in `$.", "unknown field `", "`"):
        if marker in text:
            rest = text.split(marker, 1)[1]
            return rest.split("`", 1)[0].split("[", 1)[0].split(".", 1)[0] or None
    return None


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenLogprob(msgspec.Struct, frozen=True):
    """Log-probability of a sampled token, with the top alternatives (id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = {}


class ToolCall(msgspec.Struct, frozen=True):
    """A call of one of the request's tools: `arguments` is the JSON text the model wrote."""

    id: str
    name: str
    arguments: str


class Chunk(msgspec.Struct):
    """One streamed delta. The last chunk carries `finish_reason` and `usage`."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    usage: Usage | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # on the first chunk, when asked for


class Completion(msgspec.Struct):
    """A finished request: the text is exactly the concatenation of its stream's deltas."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_token_ids: list[int] | None = None
    tool_calls: list[ToolCall] | None = None  # chat with tools: the calls read from the text
    # with `prompt_logprobs`: None for the first prompt token, then {token_id: logprob} for each one after
    prompt_logprobs: list[dict[int, float] | None] | None = None

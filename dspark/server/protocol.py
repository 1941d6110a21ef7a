"""OpenAI request bodies (pydantic) and their validation into `SamplingParams`.

    body = CompletionRequest.model_validate_json(raw, strict=True)   # 400 on any error
    params = sampling_params(body, num_prompt_tokens, max_model_len)

Types are strict, as OpenAI's API is: a string is never a number. Fields OpenAI defines
that dspark does not implement are accepted only at their neutral value (n=1,
presence_penalty=0, ...); anything else is a 400 naming the field, never silently ignored.
`ApiError` carries the status and the OpenAI error object
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dspark.sampling import SamplingParams

MAX_STOP = 16
MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # smaller temperatures overflow logits / T; they mean greedy anyway
TOP_P_FLOOR = 1e-6  # keeps top_p > 0 in float32; any top_p this small keeps only the top token
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # what torch.Generator accepts
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=2**31)]], Field(min_length=1)]


class ApiError(Exception):
    """An error the client caused (4xx) or the server hit (5xx), in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints (OpenAI's, plus vLLM's top_k and ignore_eos)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] = 0
    max_tokens: Annotated[int, Field(ge=1, le=2**31)] | None = None
    stop: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    user: str | None = None
    # accepted only at their neutral values (see `unsupported`)
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> list[tuple[str, bool]]:
        """(field, is_unsupported) pairs; any True becomes a 400."""
        return [("n", self.n != 1), ("presence_penalty", self.presence_penalty != 0.0),
                ("frequency_penalty", self.frequency_penalty != 0.0), ("logit_bias", bool(self.logit_bias))]

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Sampling):
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, bool]]:
        batched = isinstance(self.prompt, list) and len(self.prompt) > 0 and isinstance(self.prompt[0], str | list)
        return super().unsupported() + [
            ("prompt", batched and len(self.prompt) > 1), ("echo", self.echo),
            ("best_of", self.best_of not in (None, 1)), ("suffix", bool(self.suffix)),
        ]

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a one-element batch is unwrapped)."""
        p = self.prompt
        return p[0] if isinstance(p, list) and isinstance(p[0], str | list) else p  # type: ignore[return-value]

    def top_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def rendered(self) -> dict[str, str]:
        """The {"role", "content"} dict a chat template expects (text parts joined)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=2**31)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, bool]]:
        fmt = (self.response_format or {}).get("type", "text")
        return super().unsupported() + [
            ("tools", bool(self.tools)), ("response_format", fmt != "text"),
            ("top_logprobs", self.top_logprobs is not None and not self.logprobs),
        ]

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_body(cls: type[_Sampling], raw: bytes) -> Any:
    """JSON bytes -> a validated request, or ApiError(400) naming the first bad field."""
    try:
        body = cls.model_validate_json(raw or b"null", strict=True)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    for field, bad in body.unsupported():
        if bad:
            raise ApiError(400, f"dspark does not support this value of {field!r}", param=field, code="unsupported")
    return body


def _validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors(include_url=False)[0]
    loc = [str(x) for x in first.get("loc", ()) if not isinstance(x, int)]
    param = loc[0] if loc else None
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if first["type"] == "json_invalid":
        return ApiError(400, "the request body is not valid JSON", code="invalid_json")
    where = ".".join(str(x) for x in first.get("loc", ())) or "body"
    return ApiError(400, f"{where}: {first['msg']}", param=param, code="invalid_value")


def sampling_params(body: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int,
                    max_model_len: int) -> SamplingParams:
    """The engine's SamplingParams; the completion must fit the context with the prompt."""
    room = max_model_len - num_prompt_tokens
    asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if asked is not None and asked > room:
        raise ApiError(400, f"this model's context holds {max_model_len} tokens; the prompt has "
                            f"{num_prompt_tokens}, so at most {room} can be generated, but {asked} were asked",
                       param="max_tokens", code="context_length_exceeded")
    if asked is None:  # OpenAI's defaults: 16 for completions, the rest of the context for chat
        asked = min(16, room) if isinstance(body, CompletionRequest) else room
    logprobs = body.top_logprobs() if isinstance(body, CompletionRequest) else body.top_logprobs_count()
    try:
        temperature = body.temperature if body.temperature >= GREEDY_BELOW else 0.0
        return SamplingParams(temperature=temperature, top_p=max(body.top_p, TOP_P_FLOOR), top_k=body.top_k,
                              max_tokens=asked, seed=body.seed, stop=body.stop_strings(),
                              ignore_eos=body.ignore_eos, logprobs=logprobs)
    except ValueError as exc:
        raise ApiError(400, str(exc), code="invalid_value") from None

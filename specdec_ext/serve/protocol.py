"""The wire format: OpenAI's request bodies (:class:`CompletionRequest`, :class:`ChatCompletionRequest`), their
checks, and the response / stream-chunk / error bodies.

Known fields are checked strictly (a string where a number belongs is a 400 naming the field, as OpenAI's API
answers; an integer is a valid float). Unknown fields are ignored, as vLLM ignores them, so clients that send
extras (``extra_body``) keep working. Fields of the API this server does not implement (``logprobs``, ``echo``,
penalties, ...) are a 400 naming them unless left at their defaults: never silently a different answer.
Extensions, as vLLM spells them: ``top_k`` (-1 or 0: off), ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``
(the token ids of the output, in the response and in every stream chunk).

Sampling values are checked once, by the engine (:class:`~specdec_ext.engine.RequestSettings`); its ValueErrors
become 400s through :func:`engine_error`, which names the request field (``max_tokens`` for ``max_new_tokens``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from specdec_ext.engine import RequestSettings

__all__ = ["ApiError", "ChatCompletionRequest", "CompletionRequest", "engine_error", "error_body", "parse_request",
           "validation_error"]

class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 429: "rate_limit_error",
                             503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.status)


def error_body(message: str, kind: str, param: str | None, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: StrictBool = False


# fields of OpenAI's API that this server does not implement: (their default values)
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "logit_bias": (None,), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "tools": (None,), "tool_choice": (None, "none"),
               "response_format": (None,), "n": (None, 1)}


class _Common(BaseModel):
    """The sampling fields both endpoints share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: StrictStr | None = None
    temperature: StrictFloat | None = None  # None: 1 (OpenAI's default)
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool = False
    user: StrictStr | None = None

    def check_unsupported(self, raw: dict) -> None:
        for name, defaults in UNSUPPORTED.items():
            if name in raw and not any(raw[name] == d and type(raw[name]) is type(d) for d in defaults):
                what = "only n = 1 is served" if name == "n" else "not supported by this server"
                raise ApiError(400, f"{name} = {raw[name]!r}: {what}", name)

    def settings(self, max_new_tokens) -> RequestSettings:
        """The engine's settings (checked by the engine when it admits the request)."""
        top_k = 0 if self.top_k == -1 else self.top_k  # (vLLM's "off")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return RequestSettings(max_new_tokens=max_new_tokens,
                               temperature=1.0 if self.temperature is None else self.temperature,
                               top_k=0 if top_k is None else top_k, top_p=1.0 if self.top_p is None else self.top_p,
                               seed=self.seed, stop_token_ids=tuple(self.stop_token_ids or ()), stop=stop,
                               ignore_eos=self.ignore_eos)


class CompletionRequest(_Common):
    """``POST /v1/completions``: one prompt, as text or token ids (or a list holding one of them)."""

    prompt: StrictStr | list[StrictInt] | Annotated[list[StrictStr | list[StrictInt]], Field(max_length=1)]
    max_tokens: StrictInt | None = 16  # (OpenAI's default)

    def prompt_form(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return p[0]
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        c = self.content
        return {"role": self.role, "content": "".join(p.text for p in c) if isinstance(c, list) else (c or "")}


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: messages through the tokenizer's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: StrictInt | None = None  # None: the rest of the context (vLLM's default)
    max_completion_tokens: StrictInt | None = None


def validation_error(err: ValidationError) -> ApiError:
    """The first of pydantic's errors as a 400 naming its field (``messages.0.role``)."""
    first = err.errors(include_url=False)[0]
    # a union's member names (str, list[int], ...) follow the field in the location: keep the request's path
    path = []
    for part in first.get("loc", ()):
        if not (isinstance(part, int) or part in _FIELD_NAMES):
            break
        path.append(str(part))
    param = ".".join(path) or None
    got = first.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) or len(repr(got)) < 80 else type(got).__name__
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        return ApiError(400, f"{param}: a required field is missing", param)
    return ApiError(400, f"{param}: {msg} (got {shown})", param)


def parse_request(cls, raw: Any):
    """``raw`` (decoded JSON) as ``cls``, or an :class:`ApiError`."""
    if not isinstance(raw, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(raw).__name__}")
    try:
        req = cls.model_validate(raw)
    except ValidationError as err:
        raise validation_error(err) from None
    req.check_unsupported(raw)
    return req


_FIELD_NAMES = frozenset(name for model in (CompletionRequest, ChatCompletionRequest, Message, TextPart, StreamOptions)
                         for name in model.model_fields)

# the engine's names for the request's fields, longest first (stop_token_ids before stop)
_ENGINE_FIELDS = (("stop_token_ids", "stop_token_ids"), ("max_new_tokens", "max_tokens"), ("prompt_ids", "prompt"),
                  ("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"), ("seed", "seed"),
                  ("ignore_eos", "ignore_eos"), ("stop", "stop"))


def engine_error(message: str, prompt_field: str = "prompt") -> ApiError:
    """``add_request``'s ValueError as a 400 in the request's terms: the field it names (a budget that does not fit
    the context names ``max_tokens``)."""
    text = message.removeprefix("add_request: ")
    names = {eng: api if api != "prompt" else prompt_field for eng, api in _ENGINE_FIELDS}
    param = "max_tokens" if "max_new_tokens" in text else None
    if param is None:
        hits = [(text.find(eng), -len(eng), api) for eng, api in names.items() if eng in text]
        param = min(hits)[2] if hits else None  # (the first name in the message; the longer at one place)
    for eng, api in names.items():
        text = text.replace(eng, api)
    return ApiError(400, text, param)


# ---- responses ---------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(text: str, finish_reason: str | None, token_ids: list[int] | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(delta: dict | None, message: dict | None, finish_reason: str | None,
                token_ids: list[int] | None) -> dict:
    choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if delta is not None:
        choice["delta"] = delta
    if message is not None:
        choice["message"] = message
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def envelope(rid: str, kind: str, model: str, choices: list, created: int | None = None,
             usage_: dict | None = None) -> dict:
    body = {"id": rid, "object": kind, "created": created or int(time.time()), "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body

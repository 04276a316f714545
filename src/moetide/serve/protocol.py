"""OpenAI-compatible request and response bodies (pydantic), and the OpenAI error body.

Requests are validated strictly (`"5"` is not an integer, NaN/Infinity are not numbers) so a wrong
type is a 400 here rather than a surprise inside the engine loop. Unknown fields are ignored, as the
OpenAI API does; an explicit `null` means the field's default, for every field that has one.
Extensions beyond the OpenAI API: `top_k` and `ignore_eos` (vLLM's names).

`check_list_caps` refuses a stop list or a conversation over its cap from the parsed JSON, before
pydantic validates each element.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..engine.chat import MAX_CHAT_MESSAGES
from ..engine.detokenize import MAX_STOP_STRINGS, stop_strings
from ..engine.sampling import SamplingParams
from ..errors import ConfigError
from .errors import APIError, error_body

if TYPE_CHECKING:
    from .prompt import PromptEncoder

# Temperatures below this sample as greedy: dividing logits by a tinier one overflows float32.
MIN_SAMPLING_TEMPERATURE = 1e-5
DEFAULT_COMPLETION_MAX_TOKENS = 16  # as OpenAI's completions API
MAX_SEED = 2**63 - 1
# JSON can carry a lone UTF-16 surrogate ("\ud800"); no tokenizer can encode it
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_lone_surrogates(texts: list[str]) -> None:
    if any(_LONE_SURROGATE.search(text) for text in texts):
        raise ValueError("contains a lone UTF-16 surrogate, which is not valid Unicode text")


def check_list_caps(data) -> None:
    """Refuse a stop list over MAX_STOP_STRINGS or messages over MAX_CHAT_MESSAGES (400), from the
    parsed body, before each element is validated."""
    if not isinstance(data, dict):
        return
    for field, cap in (("stop", MAX_STOP_STRINGS), ("messages", MAX_CHAT_MESSAGES)):
        value = data.get(field)
        if isinstance(value, list) and len(value) > cap:
            message = f"{field} has {len(value)} entries; at most {cap} are allowed"
            raise APIError(400, message, param=field, code="invalid_value")


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_the_default(cls, data):
        """`"field": null` for a field with a default: as if the field were absent."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # extension: 0 or -1 = off
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None  # accepted and ignored
    ignore_eos: bool = False  # extension: generate exactly max_tokens tokens
    # not supported: present only to be refused by name rather than silently ignored
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None

    def check_supported(self) -> None:
        """Reject what the engine does not do, naming the field (400)."""
        self._check_unsupported_fields()
        if self.n != 1:
            raise APIError(400, "n must be 1: one choice per request is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise APIError(400, f"{name} is not supported; leave it at 0", param=name)
        try:
            stop_strings(self.stop)  # the library's caps: count, length, non-empty
        except ConfigError as e:
            raise APIError(400, str(e), param="stop", code="invalid_value") from None
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")

    def _check_unsupported_fields(self) -> None:
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported: this server does not call tools", param=name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise APIError(400, f"{name} is not supported: this server does not call tools", param=name)
        fmt = self.response_format
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise APIError(
                400,
                'response_format is not supported (only {"type": "text"}): the output is not constrained',
                param="response_format",
            )

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        temperature = self.temperature if self.temperature >= MIN_SAMPLING_TEMPERATURE else 0.0
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`. `prompt`: a string, a list of one string, or token ids."""

    prompt_param: ClassVar[str] = "prompt"

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _no_lone_surrogate(cls, value):
        _refuse_lone_surrogates(
            [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)]
        )
        return value

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise APIError(400, "logprobs is not supported", param="logprobs")
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if isinstance(self.prompt, list):
            if len(self.prompt) == 0:
                raise APIError(400, "prompt is empty", param="prompt")
            if isinstance(self.prompt[0], (str, list)) and len(self.prompt) != 1:
                raise APIError(
                    400, "send one prompt per request (a batch of prompts is not supported)", param="prompt"
                )

    @property
    def requested_max_tokens(self) -> int:
        return self.max_tokens

    def encode(self, encoder: PromptEncoder, cancel=None) -> list[int]:
        return encoder.encode_prompt(self.prompt, cancel)


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _no_lone_surrogate(cls, value):
        _refuse_lone_surrogates([value] if isinstance(value, str) else [p.text for p in value or ()])
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`: `messages` go through the checkpoint's chat template."""

    prompt_param: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs is not None:
            raise APIError(400, "logprobs is not supported", param="logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def encode(self, encoder: PromptEncoder, cancel=None) -> list[int]:
        return encoder.encode_chat([{"role": m.role, "content": m.text()} for m in self.messages], cancel)


# -- responses --------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(request_id: str, obj: str, created: int, model: str, choices: list, usage_body) -> dict:
    """The fields every completion / chat response and chunk shares."""
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body,
    }


def _choice(key: str, value, finish_reason: str | None) -> dict:
    return {"index": 0, key: value, "finish_reason": finish_reason, "logprobs": None}


def completion_body(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    created: int,
) -> dict:
    choices = [_choice("text", text, finish_reason)]
    return _envelope(
        request_id, "text_completion", created, model, choices, usage(prompt_tokens, completion_tokens)
    )


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    text: str | None = None,
    finish_reason: str | None = None,
    usage_body: dict | None = None,
) -> dict:
    choices = [] if text is None else [_choice("text", text, finish_reason)]
    return _envelope(request_id, "text_completion", created, model, choices, usage_body)


def chat_body(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    created: int,
) -> dict:
    choices = [_choice("message", {"role": "assistant", "content": text}, finish_reason)]
    return _envelope(
        request_id, "chat.completion", created, model, choices, usage(prompt_tokens, completion_tokens)
    )


def chat_text_chunk(
    request_id: str,
    model: str,
    created: int,
    text: str | None = None,
    finish_reason: str | None = None,
    usage_body: dict | None = None,
) -> dict:
    """A chat chunk with the signature of `completion_chunk`: text None = the usage-only chunk."""
    delta = None if text is None else ({"content": text} if text else {})
    return chat_chunk(request_id, model, created, delta, finish_reason, usage_body)


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict | None = None,
    finish_reason: str | None = None,
    usage_body: dict | None = None,
) -> dict:
    choices = [] if delta is None else [_choice("delta", delta, finish_reason)]
    return _envelope(request_id, "chat.completion.chunk", created, model, choices, usage_body)

"""Request shapes checked at the gateway.

Only the fields the appliance itself relies on are typed (strictly: a string
"true" is not a boolean); everything else passes through to vLLM untouched,
which validates the rest with its own OpenAI-compatible rules.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from appliance.api.errors import ApiError, validation_error

PositiveInt = Annotated[StrictInt, Field(ge=1)]
Number = StrictInt | StrictFloat


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: PositiveInt | None = None
    best_of: PositiveInt | None = None  # typed here so a bad one fails like a bad n


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[Any] | None = None


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    max_completion_tokens: PositiveInt | None = None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None


class ResponsesRequest(_Common):
    """OpenAI's Responses API (POST /v1/responses): its output limit is max_output_tokens."""

    input: StrictStr | Annotated[list[Any], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: PositiveInt | None = None


class MessagesRequest(_Common):
    """Anthropic's Messages API (POST /v1/messages): max_tokens is required there."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt
    system: StrictStr | list[Any] | None = None


def validate_body(model: type[_Common], body: Any) -> _Common:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None

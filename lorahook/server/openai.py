"""The OpenAI protocol of ``lorahook serve``: request checks, error objects, completion objects.

Plain Python: no ray, no torch, no HTTP framework, so every rule here is
tested on its own.  :class:`RequestError` is an HTTP status with OpenAI's
error object; :func:`parse_completion` checks a completion or chat body and
returns its settings; :func:`prompt_ids` turns the prompt or the messages
into token ids with the model's tokenizer; :func:`completion` builds a
whole completion object or a streamed chunk.
"""
import json

__all__ = ["RequestError", "parse_completion", "prompt_ids", "completion", "json_object",
           "DEFAULT_MAX_TOKENS"]

# OpenAI's defaults when a body gives no max_tokens
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}


class RequestError(Exception):
    """An OpenAI-style error: HTTP status, message, type, offending parameter, code."""

    def __init__(self, status, message, param=None, kind=None, code=None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error",
                             404: "invalid_request_error", 503: "server_error"}.get(status,
                                                                                  "server_error")
        self.code = code

    def body(self):
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


def json_object(value):
    """``value`` if it is a JSON object (a ``dict``), else a 400."""
    if not isinstance(value, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return value


def _number(body, name, default, lo, hi, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise RequestError(400, f"'{name}' must be {kind}, got {json.dumps(value)[:40]}", name)
    if not lo <= value <= hi:
        raise RequestError(400, f"'{name}' must be in [{lo}, {hi}], got {value}", name)
    return value


def parse_completion(body, kind):
    """The sampling settings of a completion or chat body (``RequestError`` for a bad one)."""
    json_object(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' is required: the base model's id or an adapter name",
                           "model")
    n = _number(body, "n", 1, 1, 1, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "'stop' must be a string or a list of up to 4 non-empty strings",
                           "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", "stream")
    return {
        "model": model,
        "n": n,
        "max_tokens": _number(body, "max_tokens", DEFAULT_MAX_TOKENS[kind], 1, 1 << 20,
                              integer=True),
        "temperature": float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        "top_p": float(_number(body, "top_p", 1.0, 0.0, 1.0)),
        "seed": _number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True),
        "stop": stop,
        "stream": stream,
    }


def prompt_ids(body, kind, tokenizer, vocab_size):
    """The prompt's token ids: the chat template over ``messages``, or ``prompt`` (text or ids).

    ``tokenizer`` is a transformers tokenizer (called, and its
    ``apply_chat_template`` for chat); ids must be in ``[0, vocab_size)``.
    """
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise RequestError(400, "'messages' must be a non-empty list of "
                                    "{role, content} objects with string content", "messages")
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError(400, "this model's tokenizer has no chat template: use "
                                    "/v1/completions", "messages")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return [int(t) for t in ids]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return list(tokenizer(prompt)["input_ids"])
    if (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
            for t in prompt)):
        return list(prompt)
    raise RequestError(400, f"'prompt' must be a non-empty string or a list of token "
                            f"ids in [0, {vocab_size})", "prompt")


def completion(meta, text, reason, used=None):
    """An OpenAI completion object: whole (with ``usage``), or a streamed chunk (``used`` None).

    ``meta`` is ``(id, model, created, kind, prompt tokens)``.
    """
    rid, model, created, kind, prompt_tokens = meta
    chunk = used is None
    if kind == "chat":
        choice = {("delta" if chunk else "message"): {"role": "assistant", "content": text}}
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice = {"text": text}
        obj = "text_completion"
    choice.update(index=0, finish_reason=reason, logprobs=None)
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if not chunk:
        out["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": used,
                        "total_tokens": prompt_tokens + used}
    return out

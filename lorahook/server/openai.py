"""The OpenAI protocol of ``lorahook serve``: request checks, error objects, completion objects.

Plain Python: no ray, no torch, no HTTP framework, so every rule here is
tested on its own.

- :class:`RequestError` is an HTTP status with OpenAI's error object; every
  answer that is not a success is one (``error_body``).
- :func:`parse_json` reads a body: JSON only, objects and arrays nested at
  most :data:`MAX_DEPTH` deep.  :func:`is_json_content_type` and
  :func:`check_api_key` check the headers.
- :func:`parse_completion` checks a completion or chat body before the
  request is admitted and returns its settings; every parameter is checked
  and named when it is wrong, and OpenAI parameters the server does not
  implement are refused by name unless they hold their defaults.
- :func:`prompt_ids` turns the prompt or the messages into token ids;
  :func:`fit_context` checks them and ``max_tokens`` against the context.
- :func:`parse_load` / :func:`parse_unload` check vLLM's runtime-adapter
  bodies.
- :func:`completion` builds a whole completion object or a streamed chunk.
"""
import hmac
import json
import math
import re

__all__ = ["RequestError", "error_body", "parse_json", "is_json_content_type", "check_api_key",
           "parse_completion", "prompt_ids", "fit_context", "parse_load", "parse_unload",
           "completion", "MAX_DEPTH", "MAX_NAME", "MAX_STOP", "MAX_STOPS"]

#: The deepest nesting of arrays and objects a body may have.
MAX_DEPTH = 64
#: The longest ``model`` (and adapter name) a request may give.
MAX_NAME = 256
#: At most this many stop strings, each at most this long.
MAX_STOPS, MAX_STOP = 4, 256
# OpenAI's defaults when a body gives no max_tokens (the context left, when smaller)
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}

_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 503: "server_error",
          504: "timeout_error"}


class RequestError(Exception):
    """An OpenAI-style error: HTTP status, message, type, offending parameter, code."""

    def __init__(self, status, message, param=None, kind=None, code=None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.kind = kind or _KINDS.get(status, "server_error")
        self.code = code

    def body(self):
        return error_body(str(self), self.kind, self.param, self.code)


def error_body(message, kind="server_error", param=None, code=None):
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --------------------------------------------------------------------------- headers and bodies


def is_json_content_type(value):
    """Whether a ``Content-Type`` header says JSON (``application/json``, parameters allowed)."""
    if not value:
        return False
    return value.split(";", 1)[0].strip().lower() == "application/json"


def check_api_key(authorization, key):
    """Refuse (401) an ``Authorization`` header that is not ``Bearer <key>`` (scheme in any case).

    The key is compared in constant time.  ``key`` ``None``: no key, nothing checked.
    """
    if key is None:
        return
    scheme, _, given = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8"),
                                                             key.encode("utf-8")):
        raise RequestError(401, "Incorrect API key provided", code="invalid_api_key")


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")


def _depth(raw):
    """The deepest nesting of arrays and objects in JSON text (strings skipped)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return 0
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub(b'""', raw)):
        if bracket in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def parse_json(raw):
    """A request body (bytes) as a JSON object; 400 for anything else or too deep a nesting."""
    if _depth(raw) > MAX_DEPTH:
        raise RequestError(400, f"the request body nests arrays or objects deeper than "
                                f"{MAX_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise RequestError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


# --------------------------------------------------------------------------- completions


def _shown(value):
    """A body value in a message: JSON, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _number(body, name, default, lo, hi, integer=False, lo_open=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise RequestError(400, f"'{name}' must be {kind}, got {_shown(value)}", name)
    if (isinstance(value, float) and not math.isfinite(value)) or not (
            (lo < value if lo_open else lo <= value) and value <= hi):
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise RequestError(400, f"'{name}' must be in {interval}, got {_shown(value)}", name)
    return value


# Parameters OpenAI's API has that this server accepts, per kind.
_ACCEPTED = {
    "completion": {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop",
                   "stream", "user", "n", "stream_options"},
    "chat": {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
             "seed", "stop", "stream", "user", "n", "stream_options"},
}
# Parameters it does not implement, and the values that mean "not used" (accepted).
_UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None,), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None,),
    "service_tier": (None, "auto", "default"), "store": (None, False), "metadata": (None, {}),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,),
}


def _is_default(value, defaults):
    """Whether ``value`` is one of ``defaults`` (``1`` is not ``True``, ``0.0`` is ``0``)."""
    return any(value == d and (type(value) is type(d) or (type(d) is int and type(value) is float))
               for d in defaults) or value is None


def parse_completion(body, kind):
    """The settings of a completion (``kind`` ``"completion"``) or chat body; 400 naming a bad one.

    Returns a dict: ``model``, ``max_tokens`` (``None`` when not given),
    ``temperature``, ``top_p``, ``seed``, ``stop`` (a list), ``stream``.
    The prompt or messages are :func:`prompt_ids`'s.
    """
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    for name in body:
        if name in _ACCEPTED[kind]:
            continue
        if name in _UNSUPPORTED:
            if _is_default(body[name], _UNSUPPORTED[name]):
                continue
            raise RequestError(400, f"'{name}' is not supported by this server (only its "
                                    f"default is accepted), got {_shown(body[name])}", name)
        raise RequestError(400, f"unrecognized request parameter {name[:64]!r}", name[:MAX_NAME])
    model = body.get("model")
    if not isinstance(model, str) or not model or len(model) > MAX_NAME:
        raise RequestError(400, f"'model' is required: the base model's id or an adapter name, "
                                f"a non-empty string of at most {MAX_NAME} characters", "model")
    _number(body, "n", 1, 1, 1, integer=True)
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise RequestError(400, "'stream_options' must be an object", "stream_options")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError(400, "'user' must be a string", "user")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOPS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP for s in stop)):
        raise RequestError(400, f"'stop' must be a string or a list of at most {MAX_STOPS} "
                                f"non-empty strings of at most {MAX_STOP} characters", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", "stream")
    max_tokens = _number(body, "max_tokens", None, 1, 1 << 62, integer=True)
    if kind == "chat":
        newer = _number(body, "max_completion_tokens", None, 1, 1 << 62, integer=True)
        if newer is not None and max_tokens is not None and newer != max_tokens:
            raise RequestError(400, "'max_tokens' and 'max_completion_tokens' disagree: give one",
                               "max_completion_tokens")
        max_tokens = newer if newer is not None else max_tokens
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        "top_p": float(_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)),
        "seed": _number(body, "seed", None, -(1 << 63), (1 << 64) - 1, integer=True),
        "stop": stop,
        "stream": stream,
    }


def prompt_ids(body, kind, tokenizer, vocab_size):
    """The prompt's token ids: the chat template over ``messages``, or ``prompt`` (text or ids).

    ``tokenizer`` is a transformers tokenizer (called, and its
    ``apply_chat_template`` for chat); ids must be in ``[0, vocab_size)``.
    Tokenizing can take a while for a long prompt: call this off the event loop.
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
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
        except Exception as exc:  # a template may raise on what it is given
            raise RequestError(400, f"the chat template refused the messages "
                                    f"({type(exc).__name__})", "messages") from None
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


def fit_context(n_prompt, max_tokens, context, kind):
    """``max_tokens`` for a prompt of ``n_prompt`` tokens in a context of ``context``; 400 otherwise.

    A prompt that leaves no room is refused naming ``prompt`` (``messages``
    for chat), a ``max_tokens`` that does not fit naming ``max_tokens``; an
    omitted one is OpenAI's default or the room left, whichever is smaller.
    """
    param = "messages" if kind == "chat" else "prompt"
    if n_prompt >= context:
        raise RequestError(400, f"this model's context is {context} tokens, and the prompt has "
                                f"{n_prompt}: no room for a completion", param)
    if max_tokens is None:
        return min(DEFAULT_MAX_TOKENS[kind], context - n_prompt)
    if n_prompt + max_tokens > context:
        raise RequestError(400, f"this model's context is {context} tokens, and the prompt "
                                f"({n_prompt} tokens) + max_tokens ({max_tokens}) is "
                                f"{n_prompt + max_tokens}", "max_tokens")
    return max_tokens


# --------------------------------------------------------------------------- runtime adapters


def _lora_name(body, base_id):
    name = body.get("lora_name")
    if (not isinstance(name, str) or not name or len(name) > MAX_NAME or name == base_id
            or "/" in name or "\\" in name or name in (".", "..") or "\0" in name):
        raise RequestError(400, f"'lora_name' must be a name of at most {MAX_NAME} characters, "
                                f"without '/' or '\\', other than the base model's", "lora_name")
    return name


def parse_load(body, base_id):
    """``(name, path, inplace)`` of a ``/v1/load_lora_adapter`` body."""
    name = _lora_name(body, base_id)
    path = body.get("lora_path")
    if not isinstance(path, str) or not path or "\0" in path or len(path) > 4096:
        raise RequestError(400, "'lora_path' must be the path of a PEFT adapter directory on "
                                "the server", "lora_path")
    inplace = body.get("load_inplace", False)
    if not isinstance(inplace, bool):
        raise RequestError(400, "'load_inplace' must be true or false", "load_inplace")
    return name, path, inplace


def parse_unload(body, base_id):
    """The name of a ``/v1/unload_lora_adapter`` body."""
    return _lora_name(body, base_id)


# --------------------------------------------------------------------------- answers


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

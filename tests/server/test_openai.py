"""lorahook.server.openai: the protocol's rules on their own (no ray, no torch, no HTTP)."""
import contextlib
import json

import pytest

from lorahook.server.openai import (MAX_DEPTH, RequestError, check_api_key, completion,
                                   fit_context, is_json_content_type, parse_completion, parse_json,
                                   parse_load, parse_unload, prompt_ids)


@contextlib.contextmanager
def refused(status, param=None):
    """Expect a RequestError of ``status`` naming ``param``, with OpenAI's error object."""
    with pytest.raises(RequestError) as info:
        yield info
    assert (info.value.status, info.value.param) == (status, param), str(info.value)
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


def test_a_plain_body_gives_openai_s_defaults():
    s = parse_completion({"model": "m", "prompt": "x"}, "completion")
    assert s == {"model": "m", "max_tokens": None, "temperature": 1.0, "top_p": 1.0,
                 "seed": None, "stop": [], "stream": False}


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", "1"), ("temperature", True),
    ("top_p", 0), ("top_p", 1.5), ("top_p", -1), ("max_tokens", 0), ("max_tokens", 1.5),
    ("max_tokens", "8"), ("seed", 1.0), ("seed", 1 << 70), ("n", 2), ("stream", "yes"),
    ("stop", ["a"] * 5), ("stop", "s" * 257), ("stop", [""]), ("stop", [3]), ("model", "m" * 257),
    ("model", ""), ("model", 3), ("user", 3), ("stream_options", "x"),
])
def test_every_parameter_is_checked_and_named(field, value):
    with refused(400, field):
        parse_completion({"model": "m", "prompt": "x", field: value}, "completion")


@pytest.mark.parametrize("field, value", [
    ("logprobs", 1), ("logprobs", True), ("echo", True), ("best_of", 3), ("suffix", "x"),
    ("logit_bias", {"1": 5}), ("presence_penalty", 0.5), ("frequency_penalty", -1),
    ("response_format", {"type": "json_object"}), ("tools", [{"type": "function"}]),
    ("tool_choice", "auto"), ("top_logprobs", 2), ("best_of", True), ("logprobs", 1.5),
])
def test_unimplemented_parameters_are_refused_by_name_unless_default(field, value):
    with refused(400, field) as info:
        parse_completion({"model": "m", "prompt": "x", field: value}, "completion")
    assert "not supported" in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("logprobs", None), ("echo", False), ("best_of", 1), ("logit_bias", {}),
    ("presence_penalty", 0), ("frequency_penalty", 0.0), ("response_format", {"type": "text"}),
    ("tools", []), ("n", 1), ("user", "someone"), ("logprobs", 0.0),
])
def test_defaults_of_unimplemented_parameters_are_accepted(field, value):
    parse_completion({"model": "m", "prompt": "x", field: value}, "completion")


def test_unknown_parameters_are_refused_not_ignored():
    with refused(400, "max_token") as info:
        parse_completion({"model": "m", "prompt": "x", "max_token": 3}, "completion")
    assert str(info.value) == "unrecognized request parameter 'max_token'"


def test_chat_takes_max_completion_tokens():
    s = parse_completion({"model": "m", "messages": [], "max_completion_tokens": 7}, "chat")
    assert s["max_tokens"] == 7
    with refused(400, "max_completion_tokens"):
        parse_completion({"model": "m", "messages": [], "max_completion_tokens": 7,
                          "max_tokens": 8}, "chat")
    with refused(400, "max_completion_tokens"):  # not a completions parameter
        parse_completion({"model": "m", "prompt": "x", "max_completion_tokens": 7}, "completion")


def test_context_checks_name_the_prompt_or_max_tokens():
    with refused(400, "prompt") as info:
        fit_context(100, None, 100, "completion")
    assert "context is 100 tokens" in str(info.value)
    with refused(400, "messages"):
        fit_context(120, 1, 100, "chat")
    with refused(400, "max_tokens") as info:
        fit_context(90, 11, 100, "completion")
    assert "90 tokens) + max_tokens (11) is 101" in str(info.value)
    assert fit_context(90, 10, 100, "completion") == 10
    assert fit_context(10, None, 100, "completion") == 16     # OpenAI's default
    assert fit_context(95, None, 100, "chat") == 5            # or the room left


def test_json_bodies_are_objects_of_bounded_depth():
    assert parse_json(b'{"a": [1, {"b": "[[[["}]}') == {"a": [1, {"b": "[[[["}]}
    deep = b'{"a": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}"
    with refused(400) as info:
        parse_json(deep)
    assert f"deeper than {MAX_DEPTH}" in str(info.value)
    # brackets inside strings do not count
    assert parse_json(json.dumps({"s": "[" * 500}).encode())["s"] == "[" * 500
    for raw in (b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe"):
        with refused(400):
            parse_json(raw)
    with refused(400):  # far deeper than Python's recursion limit: refused, not a crash
        parse_json(b"[" * 100_000 + b"]" * 100_000)


def test_content_types_and_keys():
    assert is_json_content_type("application/json")
    assert is_json_content_type("Application/JSON; charset=utf-8")
    assert not any(is_json_content_type(v) for v in (None, "", "text/plain",
                                                      "application/jsonx", "multipart/form-data"))
    check_api_key(None, None)
    check_api_key("Bearer k3y", "k3y")
    check_api_key("bearer k3y", "k3y")
    check_api_key("BEARER  k3y ", "k3y")
    for header in (None, "", "k3y", "Bearer", "Bearer k3", "Bearer k3yy", "Basic k3y", "Bearer ké"):
        with refused(401):
            check_api_key(header, "k3y")


def test_runtime_adapter_bodies():
    assert parse_load({"lora_name": "a", "lora_path": "/p"}, "base") == ("a", "/p", False)
    assert parse_load({"lora_name": "a", "lora_path": "/p", "load_inplace": True}, "base")[2]
    for name in ("", "base", "a/b", "..", "x" * 257, 3, None, "a\\b"):
        with refused(400, "lora_name"):
            parse_load({"lora_name": name, "lora_path": "/p"}, "base")
    for path in ("", None, 3, "a\0b"):
        with refused(400, "lora_path"):
            parse_load({"lora_name": "a", "lora_path": path}, "base")
    with refused(400, "load_inplace"):
        parse_load({"lora_name": "a", "lora_path": "/p", "load_inplace": "yes"}, "base")
    with refused(400, "lora_name"):
        parse_unload({"lora_name": "a/v1"}, "base")


class _Tokenizer:
    chat_template = "x"

    def __call__(self, text):
        return {"input_ids": [len(w) for w in text.split()]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        if messages[0]["role"] == "bad":
            raise ValueError("the template's own error, with the content " + messages[0]["content"])
        return {"input_ids": [1] * len(messages)}


def test_prompts_and_messages():
    tok = _Tokenizer()
    assert prompt_ids({"prompt": "ab c"}, "completion", tok, 10) == [2, 1]
    assert prompt_ids({"prompt": ["ab"]}, "completion", tok, 10) == [2]
    assert prompt_ids({"prompt": [3, 4]}, "completion", tok, 10) == [3, 4]
    for bad in ("", [], [10], [True], ["a", "b"], None):
        with refused(400, "prompt"):
            prompt_ids({"prompt": bad}, "completion", tok, 10)
    assert prompt_ids({"messages": [{"role": "user", "content": "x"}]}, "chat", tok, 10) == [1]
    with refused(400, "messages") as info:
        prompt_ids({"messages": [{"role": "bad", "content": "secret"}]}, "chat", tok, 10)
    assert "secret" not in str(info.value)
    with refused(400, "messages"):
        prompt_ids({"messages": [{"role": "user"}]}, "chat", tok, 10)


def test_completion_objects():
    meta = ("id1", "m", 5, "chat", 3)
    whole = completion(meta, "hi", "stop", 2)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chunk = completion(("id1", "m", 5, "completion", 3), "h", None)
    assert chunk["object"] == "text_completion" and "usage" not in chunk

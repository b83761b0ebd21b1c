"""``lorahook serve``'s options (the command line and Ray Serve's builder args), refused before Ray starts; the drain's bookkeeping."""
import argparse

import pytest

from lorahook import server as serve


def parser():
    return serve.add_arguments(argparse.ArgumentParser(prog="lorahook serve"))


def test_help_documents_every_option():
    text = parser().format_help()
    for option in ("--adapters", "--host", "--port", "--replicas", "--threads", "--capacity-bytes",
                   "--max-batch-size", "--max-adapters", "--dtype", "--address", "--api-key",
                   "--allow-runtime-adapters"):
        assert option in text, option
    args = parser().parse_args(["model"])
    assert (args.host, args.port, args.replicas, args.threads, args.max_batch_size,
            args.address) == ("127.0.0.1", 8000, 1, None, 16, "local")


@pytest.mark.parametrize("argv, option", [
    (["--threads", "0"], "--threads"),
    (["--replicas", "0"], "--replicas"),
    (["--max-batch-size", "0"], "--max-batch-size"),
    (["--port", "0"], "--port"),
    (["--max-models-per-replica", "0"], "--max-models-per-replica"),
])
def test_bad_numbers_are_refused_by_name(tmp_path, argv, option):
    args = parser().parse_args([str(tmp_path), *argv])
    with pytest.raises(ValueError, match=f"{option} must be >= 1"):
        serve.main(args)


def test_missing_directories_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="MODEL_DIR"):
        serve.main(parser().parse_args([str(tmp_path / "nope")]))
    with pytest.raises(FileNotFoundError, match="--adapters"):
        serve.main(parser().parse_args([str(tmp_path), "--adapters", str(tmp_path / "nope")]))


def test_the_hardening_options_are_documented_with_their_defaults():
    text = parser().format_help()
    for option in ("--max-model-len", "--max-body-bytes", "--max-queued-requests",
                   "--request-timeout", "--api-key-file", "--runtime-adapter-root"):
        assert option in text, option
    args = parser().parse_args(["model"])
    assert (args.max_body_bytes, args.max_queued_requests, args.request_timeout,
            args.max_model_len) == (4 << 20, 256, 600.0, None)


def test_the_key_comes_from_the_option_a_file_or_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    args = parser().parse_args([str(tmp_path), "--api-key-file", str(key_file)])
    assert serve.api_key(args, environ={"LORAHOOK_API_KEY": "sk-env"}) == "sk-from-file"
    args = parser().parse_args([str(tmp_path)])
    assert serve.api_key(args, environ={"LORAHOOK_API_KEY": "sk-env"}) == "sk-env"
    assert serve.api_key(args, environ={}) is None
    args = parser().parse_args([str(tmp_path), "--api-key", "sk-arg"])
    assert serve.api_key(args, environ={"LORAHOOK_API_KEY": "sk-env"}) == "sk-arg"
    with pytest.raises(ValueError, match="not both"):
        serve.api_key(parser().parse_args([str(tmp_path), "--api-key", "a", "--api-key-file",
                                           str(key_file)]), environ={})
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="holds no key"):
        serve.api_key(parser().parse_args([str(tmp_path), "--api-key-file", str(key_file)]),
                      environ={})


@pytest.mark.parametrize("argv, message", [
    (["--allow-runtime-adapters"], "needs --runtime-adapter-root"),
    (["--runtime-adapter-root", "."], "is for --allow-runtime-adapters"),
    (["--max-queued-requests", "0"], "--max-queued-requests must be >= 1"),
    (["--max-body-bytes", "0"], "--max-body-bytes must be >= 1"),
    (["--request-timeout", "0"], "--request-timeout must be > 0"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1"),
])
def test_settings_that_cannot_work_are_refused_before_ray_starts(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        serve.main(parser().parse_args([str(tmp_path), *argv]))


def test_a_max_model_len_above_the_model_s_context_is_refused(tmp_path):
    pytest.importorskip("transformers")
    import json
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "max_position_embeddings": 128, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "vocab_size": 10}))
    with pytest.raises(ValueError, match=r"--max-model-len 129 is more than the model's "
                                         r"context \(128 tokens\)"):
        serve.main(parser().parse_args([str(tmp_path), "--max-model-len", "129"]))


def test_many_tenants_options_have_stated_defaults_that_bound_memory(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import json
    import os
    from lorahook.server.options import default_capacity_bytes, settings_from
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "max_position_embeddings": 128, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "vocab_size": 10}))
    text = " ".join(parser().format_help().split())
    for option in ("--adapter-dtype", "--max-models-per-replica", "--resolver-capacity-bytes"):
        assert option in text, option
    assert "a quarter of this machine's memory, divided among the replicas" in text
    args = parser().parse_args([str(tmp_path), "--replicas", "2"])
    assert (args.adapter_dtype, args.max_models_per_replica) == ("float32", 64)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    settings = settings_from(args, None)
    # never unbounded: a quarter of memory over the replicas, and the shared loader their sum
    assert settings.capacity_bytes == default_capacity_bytes(2) == memory // 8
    assert settings.resolver_capacity_bytes == 2 * settings.capacity_bytes
    args = parser().parse_args([str(tmp_path), "--capacity-bytes", "1000", "--adapter-dtype",
                                "bfloat16", "--max-models-per-replica", "300",
                                "--resolver-capacity-bytes", "5000"])
    settings = settings_from(args, None)
    assert (settings.capacity_bytes, settings.adapter_dtype, settings.max_models_per_replica,
            settings.resolver_capacity_bytes) == (1000, "bfloat16", 300, 5000)
    # one shared loader per directory and dtype
    other = settings_from(parser().parse_args([str(tmp_path), "--capacity-bytes", "1000"]), None)
    assert other.resolver_name != settings.resolver_name
    with pytest.raises(SystemExit):
        parser().parse_args([str(tmp_path), "--adapter-dtype", "float64"])
    with pytest.raises(ValueError, match="--resolver-capacity-bytes must be >= 0"):
        serve.main(parser().parse_args([str(tmp_path), "--resolver-capacity-bytes", "-1"]))


# --------------------------------------------------------------------------- Ray Serve's builder

def test_builder_args_parse_as_the_command_line(tmp_path):
    from lorahook.server.options import parse_builder_args
    args = parse_builder_args({"model_dir": str(tmp_path), "adapters": str(tmp_path),
                               "replicas": "2", "max_batch_size": 4, "request_timeout": "7.5",
                               "allow_runtime_adapters": "true",
                               "runtime_adapter_root": str(tmp_path), "drain_timeout": 3})
    want = parser().parse_args([str(tmp_path), "--adapters", str(tmp_path), "--replicas", "2",
                                "--max-batch-size", "4", "--request-timeout", "7.5",
                                "--allow-runtime-adapters", "--runtime-adapter-root",
                                str(tmp_path), "--drain-timeout", "3"])
    assert vars(args) == vars(want)
    off = parse_builder_args({"model_dir": str(tmp_path), "allow_runtime_adapters": False})
    assert off.allow_runtime_adapters is False


@pytest.mark.parametrize("args, message", [
    ({}, "need 'model_dir'"),
    ({"model_dir": "m", "port": 8001}, "'port' is not an option of the application"),
    ({"model_dir": "m", "host": "0.0.0.0"}, "'host' is not an option of the application"),
    ({"model_dir": "m", "max-batch-size": 4}, "unknown option 'max-batch-size'"),
    ({"model_dir": "m", "replicas": "two"}, "--replicas: invalid int value: 'two'"),
    ({"model_dir": "m", "dtype": "float64"}, "--dtype: invalid choice: 'float64'"),
    ({"model_dir": "m", "allow_runtime_adapters": "yes"}, "must be true or false, got 'yes'"),
])
def test_builder_args_that_cannot_work_are_refused_by_name(args, message):
    from lorahook.server.options import parse_builder_args
    with pytest.raises(ValueError, match=message):
        parse_builder_args(args)
    with pytest.raises(TypeError, match="must be a dict, got list"):
        parse_builder_args([("model_dir", "m")])


def test_drain_timeout_is_documented_and_checked(tmp_path):
    assert "--drain-timeout" in parser().format_help()
    assert parser().parse_args(["model"]).drain_timeout == 30.0
    with pytest.raises(ValueError, match="--drain-timeout must be > 0"):
        serve.main(parser().parse_args([str(tmp_path), "--drain-timeout", "0"]))


def test_the_drain_waits_for_replicas_in_flight_but_not_for_silent_ones(monkeypatch):
    pytest.importorskip("ray")
    import asyncio
    import time
    from lorahook.server.state import ServerState
    monkeypatch.setattr(ServerState, "SILENT_S", 0.2)

    async def run():
        state = ServerState()
        for replica in ("a", "b", "c"):
            await state.join(replica)
        assert await state.busy() == ["a", "b", "c"]  # before the drain: every replica
        await state.leave("c")  # stopped by Serve
        await state.drain(30.0)
        await state.drain(1.0)  # a second drain changes nothing
        assert 29.0 < await state.draining() <= 30.0
        await state.report("a", 2)
        assert await state.busy() == ["a", "b"]  # b has not said yet
        time.sleep(0.3)
        await state.report("a", 1)
        assert await state.busy() == ["a"]  # b stayed silent: its node is gone
        await state.report("a", 0)
        assert await state.busy() == []

    asyncio.run(run())

"""``lorahook serve``'s command line: every option documented, bad values refused before Ray starts."""
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

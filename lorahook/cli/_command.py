"""What the ``lorahook`` command's subcommands share: exit codes, user errors, loading, text."""
import os

EXIT_OK = 0
EXIT_MISFIT = 1
EXIT_USAGE = 2


class CommandError(Exception):
    """A user mistake: printed as one line, with an exit code."""

    def __init__(self, message, code=EXIT_USAGE):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- helpers


def user_errors():
    """The exception types that mean "the user gave us a bad file or value".

    lorahook's own errors and ``OSError``; argument errors are argparse's
    (exit 2) or :class:`CommandError`.  Anything else is a bug and shows its
    traceback.
    """
    from ..errors import LoraFormatError, LoraValidationError
    return (LoraFormatError, LoraValidationError, OSError)


def one_line(exc):
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    text = " ".join(text.split())
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        text = f"{exc.strerror}: {exc.filename}"
    return text or type(exc).__name__


def adapter_files(path):
    """``(kind, config_path_or_None, safetensors_path)`` for an adapter location."""
    if os.path.isdir(path):
        config = os.path.join(path, "adapter_config.json")
        weights = os.path.join(path, "adapter_model.safetensors")
        if not os.path.exists(config):
            raise CommandError(f"{path}: not a PEFT adapter directory (no adapter_config.json)")
        return "PEFT directory", config, weights
    if not os.path.exists(path):
        raise CommandError(f"{path}: no such file or directory")
    if os.path.basename(path) == "adapter_config.json":
        return adapter_files(os.path.dirname(path) or ".")
    return "safetensors file", None, path


def load_adapter(path):
    """Load a PEFT directory (or its ``adapter_config.json``) or a bare safetensors file."""
    from ..adapter import LoraAdapter
    kind, config, _ = adapter_files(path)
    if config is not None:
        return LoraAdapter.from_peft(os.path.dirname(config))
    return LoraAdapter.from_safetensors(path)


def load_model(path):
    """The :class:`~lorahook.ModelGeometry` chosen by the file's ``model_type``."""
    from ..models import load_model_config
    if not os.path.exists(path):
        raise CommandError(f"{path}: no such file or directory")
    return load_model_config(path)


def ranges_text(indices):
    """``[0, 1, 2, 5, 7, 8]`` -> ``'0-2, 5, 7-8'``."""
    out, run = [], []
    for i in sorted(set(indices)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out)


def set_text(values, fmt="{}"):
    values = sorted(set(values))
    return ", ".join(fmt.format(v) for v in values)


def size_text(n_bytes):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n_bytes < 1024 or unit == "GiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024.0
    return f"{n_bytes} B"  # pragma: no cover

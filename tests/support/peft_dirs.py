"""Writing PEFT adapter directories by hand, for the tests that load them."""
import json

from safetensors.numpy import save_file


def write_dir(path, tensors, config, metadata=None):
    """``path`` as a PEFT directory: ``tensors`` (numpy arrays) and ``config`` (a dict)."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata=metadata or {"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path

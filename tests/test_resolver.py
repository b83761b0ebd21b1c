"""lorahook.resolver: the rules that turn a name into an adapter, on their own (no store)."""
import os
import pathlib

import numpy as np
import pytest

from lorahook import LoraAdapter, LoraFormatError, LoraLayer
from lorahook.resolver import (check_adapter, check_lookup_name, check_name, check_resolver,
                               identity, resolve, safe_component)


def _adapter(seed=0):
    rng = np.random.default_rng(seed)
    return LoraAdapter({(0, "q_proj"): LoraLayer(rng.standard_normal((2, 8)),
                                                  rng.standard_normal((8, 2)), 1.0 + seed)})


@pytest.fixture
def root(tmp_path):
    _adapter(1).save_peft(tmp_path / "alpha", architecture="llama")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("not a directory")
    return tmp_path


def test_a_directory_resolver_reads_name_as_a_peft_directory(root):
    got = resolve(str(root), "alpha")
    want = _adapter(1)
    np.testing.assert_array_equal(got.layers[(0, "q_proj")].a, want.layers[(0, "q_proj")].a)
    assert got.layers[(0, "q_proj")].scale == want.layers[(0, "q_proj")].scale


@pytest.mark.parametrize("name", ["..", ".", "a/b", "/etc", "a\\b", "x\0y", ""])
def test_names_that_leave_the_directory_are_unknown_before_any_file_is_touched(root, name,
                                                                               monkeypatch):
    assert not safe_component(name)
    touched = []
    monkeypatch.setattr(os.path, "lexists", lambda p: touched.append(p) or True)
    with pytest.raises(KeyError, match="one safe path component"):
        resolve(str(root), name)
    assert touched == []


def test_missing_and_broken_directories(root):
    with pytest.raises(KeyError, match="does not exist"):
        resolve(str(root), "nope")
    with pytest.raises(LoraFormatError, match="has no adapter_config.json"):
        resolve(str(root), "empty")
    with pytest.raises(LoraFormatError, match="is not a PEFT adapter directory"):
        resolve(str(root), "file")


def test_a_callable_answers_with_an_adapter_a_path_or_none(root):
    adapter = _adapter(2)
    answers = {"made": adapter, "path": root / "alpha", "text": str(root / "alpha")}
    assert resolve(answers.get, "made") is adapter
    assert resolve(answers.get, "path").layers[(0, "q_proj")].scale == 2.0
    assert resolve(answers.get, "text").layers[(0, "q_proj")].scale == 2.0
    with pytest.raises(KeyError, match="the resolver does not know it"):
        resolve(answers.get, "unknown")
    with pytest.raises(TypeError, match="the resolver returned int for 'x'"):
        resolve(lambda name: 3, "x")


def test_checks_of_names_resolvers_and_adapters():
    assert check_name("a") == "a"
    with pytest.raises(TypeError, match="adapter name must be a str, got int"):
        check_name(3)
    with pytest.raises(ValueError, match="non-empty"):
        check_name("")
    with pytest.raises(KeyError, match="adapter names are non-empty"):
        check_lookup_name("")
    assert check_resolver(None) is None
    assert check_resolver(pathlib.Path("/x")) == "/x"
    with pytest.raises(TypeError, match=r"resolver must be a directory .* got NoneType"):
        check_resolver(None, optional=False)
    with pytest.raises(TypeError, match="non-empty str path"):
        check_resolver("")
    with pytest.raises(TypeError, match="got bytes"):
        check_resolver(b"/x")
    with pytest.raises(TypeError, match="must be a lorahook.LoraAdapter, got str"):
        check_adapter("n", "adapter")

    class OwnApply(LoraAdapter):
        def apply(self, layer_idx, module, x, output):
            pass

    with pytest.raises(TypeError, match="with its own is_active or apply"):
        check_adapter("n", OwnApply({}))


def test_identity_tells_resolvers_apart_across_processes():
    assert identity("/a/b/../c") == ("directory", "/a/c")
    assert identity(_adapter) == ("callable", __name__, "_adapter")
    assert identity({}.get)[0] == "callable"

"""The reference's docstrings: numpydoc sections that match the signatures, examples that run.

The documentation (docs/, built with Sphinx and numpydoc) renders these
docstrings; here each public entry point's ``Parameters`` section must name
exactly its parameters, and every ``Examples`` section runs as a doctest.
The section check needs numpydoc (the ``docs`` extra) and skips without it.
"""
import doctest
import inspect

import numpy as np
import pytest

import lorahook
import lorahook.threads
import lorahook.torch

ENTRY_POINTS = [
    lorahook.apply_lora_rows,
    lorahook.apply_lora_embedding,
    lorahook.LoraLayer,
    lorahook.LoraAdapter,
    lorahook.LoraAdapter.from_peft,
    lorahook.LoraAdapter.save_peft,
    lorahook.LoraAdapter.validate_against,
    lorahook.AdapterSet,
    lorahook.AdapterSet.add,
    lorahook.AdapterSet.bind,
    lorahook.AdapterSet.bind_sequences,
    lorahook.load_model_config,
    lorahook.threads.configure,
    lorahook.torch.attach,
]


def _ray_serve():
    import lorahook.ray_serve as rs  # batch needs no ray
    try:  # the names that do import it when first read
        return [rs.batch, rs.multiplexed, rs.shared_resolver]
    except ImportError:
        return [rs.batch]


def _name(obj):
    return getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))


def _doc(obj):
    docscrape = pytest.importorskip("numpydoc.docscrape")
    return docscrape.ClassDoc(obj) if inspect.isclass(obj) else docscrape.FunctionDoc(obj)


def _documented(obj):
    names = []
    for param in _doc(obj)["Parameters"]:
        names += [n.strip() for n in param.name.split(",")]
    return names


def _signature(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    params = list(inspect.signature(target).parameters)
    return [p for p in params if p not in ("self", "cls")]


@pytest.mark.parametrize("obj", ENTRY_POINTS + _ray_serve(), ids=_name)
def test_parameters_section_names_every_parameter(obj):
    assert _documented(obj) == _signature(obj)


@pytest.mark.parametrize("obj", ENTRY_POINTS + _ray_serve(), ids=_name)
def test_every_entry_point_says_what_it_returns_or_raises(obj):
    doc = _doc(obj)
    assert doc["Summary"], "no summary line"
    if not inspect.isclass(obj):
        assert doc["Returns"] or doc["Raises"] or doc["Yields"], "no Returns or Raises"


EXAMPLES = [lorahook.apply_lora_rows, lorahook.LoraLayer, lorahook.LoraAdapter,
            lorahook.AdapterSet, lorahook.load_model_config]


@pytest.mark.parametrize("obj", EXAMPLES, ids=_name)
def test_examples_run(obj):
    tests = doctest.DocTestFinder(recurse=False).find(obj, _name(obj), globs={"np": np})
    examples = sum(len(t.examples) for t in tests)
    assert examples >= 2
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0

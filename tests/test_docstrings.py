"""The examples in the public API's docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib

import numpy as np
import pytest
import torch

import gpu_planner as gp

DOCUMENTED_MODULES = [
    "gpu_planner.pages",
    "gpu_planner.plan",
    "gpu_planner.runs",
    "gpu_planner.layout",
    "gpu_planner.head_gather",
    "gpu_planner.head_scatter",
]


@pytest.mark.parametrize("module_name", DOCUMENTED_MODULES)
def test_docstring_examples(module_name):
    module = importlib.import_module(module_name)
    results = doctest.testmod(
        module, extraglobs={"gp": gp, "np": np, "torch": torch}, optionflags=doctest.ELLIPSIS
    )
    assert results.attempted > 0, f"{module_name} has no examples"
    assert results.failed == 0

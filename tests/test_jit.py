"""The one Numba compilation rule of the CPU loops."""

import numpy as np

from gpu_planner.jit import compiled


def test_compiles_where_numba_cannot_cache():
    # Code with no writable cache location (here: no source file) still compiles.
    namespace: dict = {}
    exec("def add_one(values):\n    return values + 1", namespace)
    add_one = compiled(namespace["add_one"])
    np.testing.assert_array_equal(add_one(np.arange(3)), [1, 2, 3])

"""A plan's descriptors in host memory: the one form both backends hand to every reader."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class HostDescriptors(NamedTuple):
    """Descriptor columns and where each batch starts, in host memory."""

    columns: np.ndarray  # int64 [3, num_descriptors]: src_addrs, dst_addrs, lengths
    batch_offsets: np.ndarray  # int64 [num_batches + 1]: first descriptor of each batch, total
    batch_run_offsets: list[np.ndarray]  # per space (host, then device): int64 [num_batches + 1]

"""Device workspaces of the Triton plan, reused by size class behind events.

A plan's run tables, scan scratch and descriptor room are pieces of one
workspace (`kernels.run_scan.workspace_pieces`). Allocating them per plan
costs a torch allocation each; instead a plan takes a workspace of its size
class from its device's pool and gives it back once nothing may still touch
it: at once after its read (the host waited for the copy that followed every
kernel), or, for a plan dropped unread, once the event recorded after its
kernels has completed. A workspace is never handed to a new plan before then.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from gpu_planner.block_pool import _block_bytes

MAX_RETAINED_BYTES = 256 << 20  # free workspaces kept per device; the least recently used go first


class WorkspacePool:
    """Free device byte buffers by size, and those waiting for their last event."""

    def __init__(
        self, allocate: Callable[[int], torch.Tensor], max_retained_bytes: int = MAX_RETAINED_BYTES
    ) -> None:
        self._allocate = allocate
        self.max_retained_bytes = max_retained_bytes
        self._free: list[torch.Tensor] = []  # least recently used first
        self._pending: list[tuple[torch.Tensor, Any]] = []  # (workspace, event) given back
        self._returned: deque[tuple[torch.Tensor, Any]] = deque()  # given back, not yet seen
        self._lock = threading.Lock()
        self.allocations = 0
        self.expected_entries: dict[int, int] = {}  # descriptor entries a read copies, by class

    def take(self, nbytes: int) -> torch.Tensor:
        """The smallest free workspace of at least `nbytes` bytes, or a new one of its class."""
        with self._lock:
            self._collect()
            fitting = [workspace for workspace in self._free if workspace.numel() >= nbytes]
            if fitting:
                workspace = min(fitting, key=torch.Tensor.numel)
                self._free.remove(workspace)
                return workspace
        self.allocations += 1
        return self._allocate(_block_bytes(nbytes))

    def give(self, workspace: torch.Tensor, ready: Any = None) -> None:
        """Take `workspace` back; reusable once `ready` (None: nothing pending) has completed.

        Takes no lock (a garbage collection may call it inside `take`): the next
        `take` sees it.
        """
        self._returned.append((workspace, ready))

    def _collect(self) -> None:
        while self._returned:
            self._pending.append(self._returned.popleft())
        still_pending = []
        for workspace, ready in self._pending:
            if ready is None or ready.query():
                self._free.append(workspace)
            else:
                still_pending.append((workspace, ready))
        self._pending = still_pending
        self._evict()

    def _evict(self) -> None:
        retained = sum(workspace.numel() for workspace in self._free)
        while self._free and retained > self.max_retained_bytes:
            retained -= self._free.pop(0).numel()

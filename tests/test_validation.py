"""Bad input raises a clear error naming the argument, buffer or page, before planning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpu_planner as gp


def layout(**overrides) -> gp.BufferLayout:
    args = {"src_ptrs": [4096, 8192], "dst_ptrs": [4096, 8192], "item_lens": [16, 16]}
    return gp.BufferLayout(**{**args, **overrides})


def test_unequal_page_lists(backend_device):
    backend, device = backend_device
    with pytest.raises(gp.PlanValidationError, match="dst_pages: has 2 pages but src_pages has 3"):
        gp.plan_transfer(
            torch.arange(3, device=device),
            torch.arange(2, device=device),
            layout(),
            backend=backend,
        )
    with pytest.raises(ValueError, match="dst_device_pages: has 4 pages"):
        gp.group_runs(torch.arange(3), torch.arange(3), torch.arange(4), backend=backend)


@pytest.mark.parametrize("argument", ["src_pages", "dst_pages", "dst_device_pages"])
def test_negative_page_names_argument_and_position(backend_device, argument):
    backend, device = backend_device
    pages = {name: torch.arange(10, device=device) for name in ("src_pages", "dst_pages")}
    pages["dst_device_pages"] = torch.arange(10, device=device)
    pages[argument] = pages[argument].clone()
    pages[argument][6] = -3
    with pytest.raises(gp.PlanValidationError, match=rf"{argument}\[6\].*>= 0"):
        plan = gp.plan_transfer(
            layout=layout(dst_is_device=[False, True]), backend=backend, **pages
        )
        plan.materialize()


def test_device_buffer_without_device_pages():
    with pytest.raises(gp.PlanValidationError, match="buffer 1 is device-backed"):
        gp.plan_transfer(np.arange(4), np.arange(4), layout(dst_is_device=[False, True]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dst_ptrs": [1]}, "dst_ptrs: has 1 entries but src_ptrs has 2"),
        ({"item_lens": [16, 16, 16]}, "item_lens: has 3 entries"),
        ({"dst_is_device": [True]}, "dst_is_device: has 1 entries"),
        ({"src_lens": [1, 2, 3]}, "src_lens: has 3 entries"),
        ({"item_lens": [16, 0]}, r"item_lens\[1\] = 0: must be >= 1 \(buffer 1\)"),
        ({"dst_ptrs": [4096, -1]}, r"dst_ptrs\[1\] = -1"),
    ],
)
def test_layout_errors_name_the_list_and_buffer(overrides, message):
    with pytest.raises(gp.PlanValidationError, match=message):
        layout(**overrides)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_batch_limit(bad):
    with pytest.raises(gp.PlanValidationError, match="max_batch_pages"):
        gp.plan_transfer(np.arange(4), np.arange(4), layout(), max_batch_pages=bad)


def test_non_integer_pages_rejected():
    with pytest.raises(gp.PlanValidationError, match="src_pages: expected an integer"):
        gp.plan_transfer(np.arange(4.0), np.arange(4), layout())
    with pytest.raises(gp.PlanValidationError, match="dst_pages: expected a 1-D"):
        gp.plan_transfer(np.arange(4), np.arange(4).reshape(2, 2), layout())


@pytest.mark.parametrize("side", ["src", "dst"])
def test_descriptor_past_buffer_end_names_buffer_and_page(backend_device, side):
    """Buffers hold 8 pages of 16 bytes; pages 6..9 on `side` reach past the end."""
    backend, device = backend_device
    bounded = layout(**{f"{side}_lens": [16 * 8, 16 * 8]})
    in_range = torch.tensor([0, 1, 2, 3], device=device)
    pages = {"src_pages": in_range, "dst_pages": in_range}
    last_fitting = gp.plan_transfer(
        layout=bounded, backend=backend, **{**pages, f"{side}_pages": in_range + 4}
    )
    assert last_fitting.num_descriptors == 2
    with pytest.raises(gp.BoundsError, match=rf"buffer 0: {side} pages 6\.\.9 .*range: 8"):
        gp.plan_transfer(
            layout=bounded, backend=backend, **{**pages, f"{side}_pages": in_range + 6}
        ).materialize()


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(gp.PlanValidationError, match="TRITON_INTERPRET=1"):
        gp.plan_transfer(np.arange(4), np.arange(4), layout(), backend="triton")

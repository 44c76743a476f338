"""A decode's page size compiles the prefill's unit-page gathers at its registration.

`staging_warmup.unit_copies` (the geometry) and `UnitGathers` (per manager, per
unit, on the KV's GPU only, never raising), through `PrefillPageSizes` as the
registration hook calls it. Triton's compiles across a real repaged send are
counted in `tests/kernels/test_staged_send_compiles.py`.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from suite_support import set_knob

from gpu_planner import settings
from gpu_planner.integration.sglang import fallback as sglang_fallback
from gpu_planner.integration.sglang import page_sizes, staging_warmup

HEAD_BYTES = 256


def test_unit_copies_are_the_staged_pages_and_head_slices_at_the_gcd_of_the_page_sizes():
    """The entries of `prefill_copies` at gcd(P, Q) tokens a page: the staged gather of whole
    unit pages, and the gathered head slices (same slices and copy unit) on unit pages; the
    staged gather alone for MLA or unequal item lengths; nothing where the unit is P."""
    ptrs, item_lens = [4096 * (buffer + 1) for buffer in range(4)], [64 * 2 * HEAD_BYTES] * 4
    own = staging_warmup.prefill_copies(ptrs, item_lens, 64, 2, mla=False)[1]
    for decode_page_size, unit in ((16, 16), (1, 1), (48, 16), (96, 32)):
        staged, copies = staging_warmup.unit_copies(ptrs, item_lens, 64, 2, False, decode_page_size)
        assert (staged.page_size, staged.scatter) == (1, False)
        assert staged.slice_lens == (unit * 2 * HEAD_BYTES,) * 4  # a unit page of each buffer
        assert copies.page_size == unit and not copies.scatter
        assert (copies.slice_lens, copies.unit) == (own.slice_lens, own.unit) == ((256, 512), 16)
    for decode_page_size in (64, 128):  # 64 divides it: the manager's own pages
        assert staging_warmup.unit_copies(ptrs, item_lens, 64, 2, False, decode_page_size) == []
    for mla, lens in ((True, item_lens), (False, [64 * 512, 64 * 256])):
        (staged,) = staging_warmup.unit_copies(ptrs, lens, 64, 2, mla, 16)
        assert staged.slice_lens == tuple(length // 4 for length in lens)


class Manager:
    """A prefill manager as the warm-up reads it (a class: a weak key, as sglang's is)."""

    def __init__(self, kv: torch.Tensor, page_size: int, kv_heads: int = 2) -> None:
        self.disaggregation_mode = SimpleNamespace(name="PREFILL")
        self.kv_args = SimpleNamespace(
            kv_data_ptrs=[kv.data_ptr() + 4096 * buffer for buffer in range(4)],
            kv_item_lens=[page_size * kv_heads * HEAD_BYTES] * 4,
            page_size=page_size,
            kv_head_num=kv_heads,
        )


@pytest.fixture
def gathers(monkeypatch, host_cuda):
    """`PrefillPageSizes` with send slots on; every gather launch's page size, in order."""
    from gpu_planner.kernels import head_gather

    set_knob(monkeypatch, settings.GATHER_STAGING_BYTES.name, str(1 << 20))
    launched: list[int] = []
    monkeypatch.setattr(
        head_gather,
        "launch_gather_head_slices",
        lambda staging, pages, entries, page_size: launched.append(page_size),
    )
    kv = torch.zeros(4 * 4096, dtype=torch.uint8)
    prefill = page_sizes.PrefillPageSizes()
    yield SimpleNamespace(prefill=prefill, launched=launched, kv=kv, runtime=host_cuda)


def launches(page_size: int, decode_page_size: int) -> list[int]:
    """The gather launches (their page sizes) of a `Manager`'s unit copies toward the decode."""
    geometry = ([0] * 4, [page_size * 2 * HEAD_BYTES] * 4, page_size, 2, False)
    copies = staging_warmup.unit_copies(*geometry, decode_page_size)
    return [c.page_size for c in copies for _ in range(len(c.shapes()) * len(c.page_dtypes))]


def test_a_registration_compiles_the_units_its_page_size_adds_once_per_manager(gathers):
    """64 -> 16 and 16 -> 1 each add a unit; 16 -> 64 and equal sizes add none; a second
    decode of a page size with the same unit compiles nothing more."""
    gathers.runtime.place(gathers.kv, 0)
    page_64, page_16 = Manager(gathers.kv, 64), Manager(gathers.kv, 16)
    for manager in (page_64, page_16):
        gathers.prefill.manager_built(manager)
    gathers.prefill.registered("decode-a", 16)  # page_64 gets unit 16; page_16 has it
    # The staged gather copies whole unit pages (launched as pages of 1), the head slices 16.
    assert gathers.launched == launches(64, 16) and set(gathers.launched) == {1, 16}
    gathers.launched.clear()
    for session, decode_page_size in (("decode-b", 48), ("decode-c", 64), ("decode-d", None)):
        gathers.prefill.registered(session, decode_page_size)
    gathers.prefill.registered("decode-a", 16)  # registers again
    assert gathers.launched == []
    gathers.prefill.registered("decode-e", 1)  # unit 1 for both
    assert gathers.launched == launches(64, 1) + launches(16, 1) and set(gathers.launched) == {1}


def test_host_kv_or_no_slots_compile_nothing(gathers, monkeypatch):
    host = Manager(gathers.kv, 64)  # host KV: its copies run on the CPU loops
    gathers.prefill.manager_built(host)
    gathers.prefill.registered("decode", 16)
    set_knob(monkeypatch, settings.GATHER_STAGING_BYTES.name, "0")
    device_kv = torch.zeros(4 * 4096, dtype=torch.uint8)
    gathers.runtime.place(device_kv, 0)
    no_slots = Manager(device_kv, 64)  # slots off: it sends no gathered send
    gathers.prefill.manager_built(no_slots)
    gathers.prefill.registered("decode", 1)
    assert gathers.launched == []


def test_a_manager_is_kept_weakly(gathers):
    manager = Manager(gathers.kv, 64)
    gathers.prefill.manager_built(manager)
    ended = weakref.ref(manager)
    del manager
    gc.collect()
    assert ended() is None


def test_a_failed_compile_is_logged_and_counted_never_raised(gathers, monkeypatch):
    monkeypatch.setattr(sglang_fallback, "_logged_keys", set())
    gathers.runtime.place(gathers.kv, 0)
    broken = Manager(gathers.kv, 64)
    gathers.prefill.manager_built(broken)
    del broken.kv_args.kv_item_lens
    gathers.prefill.registered("decode", 16)  # returns
    assert "compile" in sglang_fallback._logged_keys
    assert gathers.prefill.decode_page_size("decode") == 16

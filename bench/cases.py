"""The sweeps: the issue's target point, the default one-factor-at-a-time sweep, a quick one."""

from __future__ import annotations

import dataclasses
import itertools

from bench.inputs import BenchCase

TARGET = BenchCase(
    tokens=128 * 1024, page_size=64, buffers=61, mean_run=8, device_share=0.5, batch_pages=0
)
TARGET_PAGE_1 = dataclasses.replace(TARGET, page_size=1)


def _vary(**values: list) -> list[BenchCase]:
    """The target point with one parameter swept over `values`."""
    ((field, options),) = values.items()
    return [dataclasses.replace(TARGET, **{field: option}) for option in options]


def default_cases() -> list[BenchCase]:
    """Tokens x page size, then buffers, fragmentation, device share, batch limit around TARGET."""
    token_counts = [4 * 1024, 16 * 1024, 64 * 1024, 128 * 1024, 256 * 1024]
    cases = [
        dataclasses.replace(TARGET, tokens=tokens, page_size=page_size)
        for page_size, tokens in itertools.product([64, 16, 1], token_counts)
    ]
    cases += _vary(buffers=[1, 8, 32, 122])
    cases += _vary(mean_run=[1, 2, 32, 128])
    cases += _vary(device_share=[0.0, 0.25, 1.0])
    cases += _vary(batch_pages=[128, 1024])
    cases.append(dataclasses.replace(TARGET_PAGE_1, batch_pages=1024))
    return list(dict.fromkeys(cases))


def quick_cases() -> list[BenchCase]:
    """A few small cases that still cover both page spaces, batch cuts and page size 1."""
    return [
        BenchCase(4096, 1, 4, 4, 0.5, 0),
        BenchCase(4096, 16, 3, 2, 0.0, 64),
        BenchCase(8192, 1, 5, 8, 1.0, 1000),
        BenchCase(6000, 64, 2, 1, 0.5, 0),
    ]


def target_cases() -> list[BenchCase]:
    return [TARGET, TARGET_PAGE_1]


def grid_cases(**lists: list | None) -> list[BenchCase]:
    """The cartesian product of the given lists; a parameter left out keeps TARGET's value."""
    options = {
        field.name: lists.get(field.name) or [getattr(TARGET, field.name)]
        for field in dataclasses.fields(BenchCase)
    }
    return [BenchCase(*values) for values in itertools.product(*options.values())]

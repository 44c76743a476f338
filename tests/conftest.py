"""Backend matrix for the tests.

Without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1,
set here before triton is imported). On a GPU machine run the suite once as
is (kernels on CUDA) and once with TRITON_INTERPRET=1 (the interpreter twins).
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from gpu_planner.kernels import interpreter_enabled  # noqa: E402

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("ci")

from suite_support import ON_CUDA  # noqa: E402


def _backend_params() -> list:
    triton_cpu = pytest.param(
        ("triton", "cpu"),
        id="triton-interpreter",
        marks=pytest.mark.skipif(
            not interpreter_enabled(), reason="Triton interpreter off (CUDA twin runs)"
        ),
    )
    triton_cuda = pytest.param(
        ("triton", "cuda"),
        id="triton-cuda",
        marks=pytest.mark.skipif(
            not ON_CUDA, reason="no CUDA device (the triton-interpreter twin runs)"
        ),
    )
    return [pytest.param(("cpu", "cpu"), id="cpu"), triton_cpu, triton_cuda]


@pytest.fixture(scope="session", params=_backend_params())
def backend_device(request) -> tuple[str, torch.device]:
    backend, device = request.param
    return backend, torch.device(device)


@pytest.fixture
def host_cuda(monkeypatch):
    """The planner's CUDA host logic on CPU tensors, through the host stand-in.

    Staging, events, streams and device guards run as on a GPU
    (tests/cuda_standin.py), with a staging pool of their own whose free
    blocks are overwritten after every wait.
    """
    from cuda_standin import HostCudaRuntime, scribble_free_blocks

    from gpu_planner import pinned_copies
    from gpu_planner.cuda_runtime import use_cuda_runtime

    pool = pinned_copies.pinned_pool()
    monkeypatch.setattr(pinned_copies, "_pinned_pool", pool)
    with use_cuda_runtime(HostCudaRuntime(after_wait=scribble_free_blocks(pool))) as runtime:
        yield runtime


@pytest.fixture(
    params=[
        pytest.param(
            "host-stand-in",
            marks=pytest.mark.skipif(
                not interpreter_enabled(),
                reason="the stand-in runs its kernels on the Triton interpreter (cuda twin runs)",
            ),
        ),
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not ON_CUDA, reason="no CUDA device (stand-in twin runs)"),
        ),
    ]
)
def cuda_path(request) -> torch.device:
    """The torch device whose tensors take the CUDA path: CPU through the stand-in, or CUDA."""
    if request.param == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    request.getfixturevalue("host_cuda")
    return torch.device("cpu")


@pytest.fixture
def send_signature_changed(monkeypatch):
    """The sglang plugin sees a generic send whose parameters lost `bootstrap_room`."""
    import dataclasses

    from gpu_planner.integration.sglang import plugin

    records = plugin.hook_records

    def changed_records() -> list:
        return [
            dataclasses.replace(record, parameters=record.parameters[:-1])
            if record.target == plugin.SEND_TARGET
            else record
            for record in records()
        ]

    monkeypatch.setattr(plugin, "hook_records", changed_records)


@pytest.fixture(autouse=True)
def knobs_read_per_test():
    """Each test's first `settings.loaded` parses the environment as the test set it."""
    from gpu_planner import settings as knobs

    knobs.forget_loaded()
    yield
    knobs.forget_loaded()


@pytest.fixture(autouse=True)
def per_token_slices_outside_gathered_tests(request, monkeypatch):
    """The per-token slice tests send from made-up addresses: they pin the per-token path.

    A head-sliced send from a lower prefill TP gathers its KV bytes into
    staging (`integration/sglang/gathered.py`), which reads the source
    buffers; tests that check per-token descriptors against sglang's use
    buffers that are only addresses. In tests/integration/sglang outside
    `test_gathered*` the gathered path is off (`GPU_PLANNER_GATHER_STAGING_BYTES=0`,
    the setting's own off switch).
    """
    sglang_tests = request.path.parent.name == "sglang"
    if sglang_tests and not request.module.__name__.startswith("test_gathered"):
        monkeypatch.setenv("GPU_PLANNER_GATHER_STAGING_BYTES", "0")

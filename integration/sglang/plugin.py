"""sglang plugin: plan sglang's Mooncake KV transfers with gpu_planner.

sglang's `load_plugins()` calls `register` through the `sglang.srt.plugins`
entry point named `gpu_planner`. It registers AROUND hooks on
`MooncakeKVManager._send_kvcache_generic`, the head-sliced sends
(`send_kvcache_slice`, `_send_swa_state_slice`), `kv_to_page_indices`, the
decode's `DecodePreallocQueue.pop_preallocated` and `_pre_alloc` (a HiSparse
request's two page spaces in one launch, `decode_pages`) and receive staging's
messages with sglang's `HookRegistry`, after checking that each target still has the
signature and the code of sglang 0.5.23 that the hooks mirror
(`sglang_sources`): any other target runs sglang's own code, and one WARNING
names the sglang version and every target left. Each hook is one
`HookRecord` (target, hook, the target's parameters, what to compile);
`register` iterates them and wraps each hook in `fallback.around`.
Every knob is parsed when `register` runs (an invalid one: no hook at all);
`GPU_PLANNER_DISABLE=1` turns the plugin off. What the registered hooks run
is compiled by AFTER hooks on `MooncakeKVManager.__init__`: the CPU loops
(`compile_after_manager_init`, which also times the page hook against
sglang's own path: `pages.choose_page_path`), and the Triton kernels on the process's GPU,
once sglang selected it (`warm_up_gpu`: the planner's, and the staging's
gathers and scatters for the manager's KV geometry).
sglang loads plugins in every process (tokenizer, detokenizer, schedulers) and
builds the manager only in a scheduler, before it serves a request: the others
compile nothing (about a second each on a CPU), and no request waits.
Registering never touches CUDA: plugins load before sglang selects each
rank's GPU, so a CUDA call here would create a context on GPU 0 in every rank.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import pkgutil
from collections.abc import Callable

from gpu_planner import cpu_backend, head_scatter, head_slices, settings
from gpu_planner.integration.sglang.counters import record_fallback
from gpu_planner.integration.sglang.fallback import around, best_effort, log_fallback_once
from gpu_planner.integration.sglang.sglang_sources import (
    MIRRORED_SGLANG,
    SOURCE_FINGERPRINTS,
    SUPPORTED_SGLANG,
    sglang_version,
    source_fingerprint,
)

logger = logging.getLogger(__name__)

SEND_TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._send_kvcache_generic"
SLICE_TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache_slice"
SWA_SLICE_TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._send_swa_state_slice"
PAGES_TARGET = "sglang.srt.mem_cache.common.kv_to_page_indices"
_DECODE_QUEUE = "sglang.srt.disaggregation.decode.DecodePreallocQueue"
POP_PREALLOCATED_TARGET = f"{_DECODE_QUEUE}.pop_preallocated"
PRE_ALLOC_TARGET = f"{_DECODE_QUEUE}._pre_alloc"
WARMUP_TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.__init__"
# Receive staging (`prefill_routes`, `staged_send`: prefill; `receive_staging`: decode).
_MOONCAKE = "sglang.srt.disaggregation.mooncake.conn"
_COMMON = "sglang.srt.disaggregation.common.conn.CommonKVManager"
REGISTRATION_MESSAGE_TARGET = f"{_MOONCAKE}.MooncakeKVManager.build_receiver_registration_message"
METADATA_MESSAGE_TARGET = f"{_MOONCAKE}.MooncakeKVManager.build_receiver_metadata_message"
CHUNK_READY_TARGET = f"{_COMMON}.handle_chunk_ready"
PREFILL_STATUS_TARGET = f"{_COMMON}.apply_prefill_status"
STATUS_PARSE_TARGET = f"{_COMMON}.parse_kv_status_message"
UPDATE_STATUS_TARGET = f"{_COMMON}.update_status"
RECEIVER_CLEAR_TARGET = "sglang.srt.disaggregation.common.conn.CommonKVReceiver.clear"
REGISTRATION_INFO_TARGET = f"{_MOONCAKE}.KVArgsRegisterInfo.from_zmq"
TRANSFER_INFO_TARGET = f"{_MOONCAKE}.TransferInfo.from_zmq"
STATUS_ENCODE_TARGET = f"{_COMMON}._encode_kv_status_message"
# Different page sizes (`page_sizes`), besides the wire hooks above.
PARALLEL_INFO_TARGET = f"{_COMMON}.try_ensure_parallel_info"
PREFILL_INFO_TARGET = "sglang.srt.disaggregation.common.conn.PrefillServerInfo.__post_init__"
SEND_METADATA_TARGET = "sglang.srt.disaggregation.common.conn.CommonKVReceiver.send_metadata"
# Hooks that work only together: one that cannot register keeps the whole set out.
DECODE_STAGING = "receive staging, decode side"
PREFILL_STAGING = "receive staging, prefill side"
TWO_PAGE_SPACES = "HiSparse page spaces in one launch"
DECODE_PAGE_SIZES = "other page sizes, decode side"

Parameters = tuple[tuple[str, object], ...]


def call_parameters(call_type: type, method: bool) -> Parameters:
    """(name, default) of the target a call dataclass mirrors: `self` first for a method."""
    empty = inspect.Parameter.empty
    fields = tuple(
        (field.name, empty if field.default is dataclasses.MISSING else field.default)
        for field in dataclasses.fields(call_type)
    )
    return ((("self", empty),) if method else ()) + fields


@dataclasses.dataclass(frozen=True)
class HookRecord:
    """One sglang target and gpu_planner's hook on it.

    `hook` takes the target's own arguments and raises `fallback.Fallback` to
    run the original (`fallback.around` enforces the contract); a hook with
    `takes_original` is registered as it is: it calls the original itself,
    returns what the original returned (with what the plugin adds to it) and
    lets no exception of its own out. `parameters` are the target's, as
    sglang 0.5.23 has them; `compile` runs once per process, after sglang
    built its first Mooncake KV manager (`compile_after_manager_init`), so no
    request waits for compilation. Records of one `group` register all
    together or not at all.
    """

    target: str
    hook: Callable
    parameters: Parameters
    compile: Callable[[], None] | None = None
    takes_original: bool = False
    group: str | None = None


def plugin_disabled() -> bool:
    """True when GPU_PLANNER_DISABLE asks for sglang's own code."""
    return settings.loaded(settings.DISABLE)


def register() -> None:
    """Register gpu_planner's hooks with sglang (the `sglang.srt.plugins` entry point).

    Every knob is parsed here, once (`settings.load`): with any value not
    accepted, one error names it and no hook is registered, so sglang serves
    with its own code.
    """
    try:
        settings.load()
    except settings.SettingError as error:
        logger.error("gpu_planner: registering no hook, sglang runs its own code: %s", error)
        return
    if plugin_disabled():
        logger.info("gpu_planner: GPU_PLANNER_DISABLE is set; sglang plans its own transfers")
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        records = hook_records()
    except ImportError as error:
        log_fallback_once(
            f"sglang's Mooncake connector does not import ({error})", key="no mooncake connector"
        )
        return
    from gpu_planner.integration.sglang import page_sizes, receive_staging

    refusals = why_not_registered(records)
    groups_out = {r.group for r in records if r.group is not None and refusals[r.target]}
    for group in sorted(groups_out):
        record_fallback(f"hooks not registered: {group}")
    receive_staging.decode_hooks_registered(DECODE_STAGING not in groups_out)
    page_sizes.decode_hooks_registered(not {DECODE_STAGING, DECODE_PAGE_SIZES} & groups_out)
    prefill_sends = refusals[SEND_TARGET] is None and refusals[SLICE_TARGET] is None
    page_sizes.PREFILL.hooks_registered(PREFILL_STAGING not in groups_out and prefill_sends)
    left = left_to_sglang(records, refusals)
    if left:
        logger.warning("gpu_planner: %s", left)
    compiles: dict[Callable[[], None], str] = {}  # each compile once, by its first target
    for record in records:
        if refusals[record.target] is not None:
            continue
        hook = record.hook if record.takes_original else around(record.hook)
        HookRegistry.register(record.target, hook, HookType.AROUND)
        if record.compile is not None:
            compiles.setdefault(record.compile, record.target)
    _pending_compiles[:] = [(target, compile) for compile, target in compiles.items()]
    if compiles:
        HookRegistry.register(WARMUP_TARGET, compile_after_manager_init, HookType.AFTER)
    if any(refusal is None for refusal in refusals.values()):
        HookRegistry.register(WARMUP_TARGET, warm_up_gpu, HookType.AFTER)  # per manager
        HookRegistry.register(WARMUP_TARGET, page_sizes.manager_built_hook, HookType.AFTER)


# What the registered hooks run, still to compile in this process: (target, compile).
_pending_compiles: list[tuple[str, Callable[[], None]]] = []


def compile_after_manager_init(result: None, *args: object, **kwargs: object) -> None:
    """AFTER sglang builds its Mooncake KV manager: compile what the registered hooks run, once.

    A failed compile is logged and counted, never raised: the hook compiles on
    first use, or falls back.
    """
    while True:
        # Popped, not tested first: with two managers built at once, the list emptied between
        # a test and a pop would raise IndexError out of sglang's `__init__`.
        try:
            target, compile = _pending_compiles.pop(0)
        except IndexError:
            return None
        try:
            compile()
        except Exception as error:  # a failed compile must not stop sglang
            log_fallback_once(f"compiling for {target} failed ({error})", "compile")


def warm_up_gpu(
    result: None = None, manager: object = None, *args: object, **kwargs: object
) -> None:
    """AFTER sglang builds a Mooncake KV manager: compile every Triton kernel variant a request
    of it can launch, so none compiles inside one.

    The planner's kernels (`gp.warmup`: the page hook's conversion) on this
    process's GPU, which sglang selected by now, and the head-slice gathers or
    scatters of `manager`'s staging on its KV's GPU (`staging_warmup`: their
    variants follow its KV geometry, so each manager's are compiled). A
    process that never initialised CUDA is left alone; a failure is logged
    and counted, never raised (a request would compile what is missing).
    """
    import torch

    from gpu_planner.integration.sglang.staging_warmup import warm_up_staging

    with best_effort("compiling the GPU kernels failed", "compile"):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            from gpu_planner import warmup

            warmup(torch.device("cuda", torch.cuda.current_device()))
        if manager is not None:
            warm_up_staging(manager)


def hook_records() -> list[HookRecord]:
    """Every hook, in registration order. ImportError without sglang's Mooncake connector."""
    # Imported here: these pull in sglang's Mooncake connector, which only
    # sglang processes (not `import gpu_planner`) should pay for.
    from sglang.srt.disaggregation.common import conn as common_conn

    from gpu_planner.integration.sglang import (
        decode_pages,
        page_sizes,
        pages,
        prefill_routes,
        receive_staging,
        send,
        send_slice,
    )
    from gpu_planner.integration.sglang.entries import SendCall

    empty = inspect.Parameter.empty
    metadata_parameters = tuple(
        (name, empty)
        for name in (
            "self",
            "bootstrap_room",
            "required_dst_info_num",
            "kv_indices",
            "aux_index",
            "state_indices",
            "decode_prefix_len",
            "is_dummy",
        )
    ) + (("device_kv_indices", None),)
    status_parameters = (
        ("self", empty),
        ("bootstrap_room", empty),
        ("status", empty),
        ("prefill_rank", empty),
        ("failure_reason", None),
    )
    # sglang 0.5.23's `send_metadata` default; a release without it registers no such hook.
    destinations = getattr(common_conn, "KVTransferDestination", None)
    device_destination = getattr(destinations, "DEVICE", "KVTransferDestination.DEVICE")
    encode_parameters = (
        ("self", empty),
        ("bootstrap_room", empty),
        ("status", empty),
        ("failure_reason", empty),
    )

    return [
        HookRecord(
            SEND_TARGET,
            send.send_kvcache_generic_hook,
            call_parameters(SendCall, method=True),
            cpu_backend.compile_kernels,  # sends plan on the CPU backend
        ),
        HookRecord(
            SLICE_TARGET,
            send_slice.send_kvcache_slice_hook,
            call_parameters(send_slice.SliceCall, method=True),
            head_slices.compile_kernels,
        ),
        HookRecord(
            SWA_SLICE_TARGET,
            send_slice.send_swa_state_slice_hook,
            call_parameters(send_slice.SwaSliceCall, method=True),
            head_slices.compile_kernels,
        ),
        HookRecord(
            PAGES_TARGET,
            pages.kv_to_page_indices_hook,
            call_parameters(pages.PagesCall, method=False),
            pages.choose_page_path,  # the hook or sglang's own path, timed on this GPU
        ),
        HookRecord(
            POP_PREALLOCATED_TARGET,
            decode_pages.pop_preallocated_hook,
            (
                ("self", empty),
                ("rids_to_check", None),
                ("pp_good_rids", None),
                ("pp_bad_rids", None),
            ),
            takes_original=True,
            group=TWO_PAGE_SPACES,
        ),
        HookRecord(
            PRE_ALLOC_TARGET,
            decode_pages.pre_alloc_hook,
            (("self", empty), ("req", empty))
            + tuple((name, None) for name in ("prefix_indices", "prefix_len", "total_prefix_len")),
            takes_original=True,
            group=TWO_PAGE_SPACES,
        ),
        HookRecord(
            REGISTRATION_MESSAGE_TARGET,
            receive_staging.registration_message_hook,
            (("self", empty),),
            takes_original=True,
            group=DECODE_STAGING,
        ),
        HookRecord(
            METADATA_MESSAGE_TARGET,
            receive_staging.metadata_message_hook,
            metadata_parameters,
            takes_original=True,
            group=DECODE_STAGING,
        ),
        HookRecord(
            CHUNK_READY_TARGET,
            receive_staging.chunk_ready_hook,
            (("self", empty), ("msg", empty)),
            head_scatter.compile_kernels,  # decodes scatter staged chunks on the CPU loop
            takes_original=True,
            group=DECODE_STAGING,
        ),
        HookRecord(
            STATUS_PARSE_TARGET,
            receive_staging.status_message_hook,
            (("self", empty), ("msg", empty)),
            takes_original=True,
            group=DECODE_STAGING,
        ),
        HookRecord(
            PREFILL_STATUS_TARGET,
            receive_staging.prefill_status_hook,
            status_parameters,
            takes_original=True,
            group=DECODE_STAGING,
        ),
        HookRecord(
            UPDATE_STATUS_TARGET,
            receive_staging.update_status_hook,
            (("self", empty), ("bootstrap_room", empty), ("status", empty)),
            takes_original=True,
            group=DECODE_STAGING,
        ),
        HookRecord(
            RECEIVER_CLEAR_TARGET,
            receive_staging.receiver_clear_hook,
            (("self", empty),),
            takes_original=True,
            group=DECODE_STAGING,
        ),
        HookRecord(
            REGISTRATION_INFO_TARGET,
            prefill_routes.registration_info_hook,
            (("msg", empty),),
            takes_original=True,
            group=PREFILL_STAGING,
        ),
        HookRecord(
            TRANSFER_INFO_TARGET,
            prefill_routes.transfer_info_hook,
            (("msg", empty),),
            takes_original=True,
            group=PREFILL_STAGING,
        ),
        HookRecord(
            STATUS_ENCODE_TARGET,
            prefill_routes.status_message_hook,
            encode_parameters,
            takes_original=True,
            group=PREFILL_STAGING,
        ),
        HookRecord(
            PARALLEL_INFO_TARGET,
            page_sizes.parallel_info_hook,
            (("self", empty), ("bootstrap_addr", empty)),
            takes_original=True,
            group=DECODE_PAGE_SIZES,
        ),
        HookRecord(
            PREFILL_INFO_TARGET,
            page_sizes.prefill_info_hook,
            (("self", empty),),
            takes_original=True,
            group=DECODE_PAGE_SIZES,
        ),
        HookRecord(
            SEND_METADATA_TARGET,
            page_sizes.send_metadata_hook,
            (
                ("self", empty),
                ("kv_indices", empty),
                ("aux_index", None),
                ("state_indices", None),
                ("decode_prefix_len", None),
                ("destination", device_destination),
                ("device_kv_indices", None),
            ),
            takes_original=True,
            group=DECODE_PAGE_SIZES,
        ),
    ]


def why_not_registered(records: list[HookRecord]) -> dict[str, str | None]:
    """Each record's target: why its hook would not register (its own mismatch, or another
    of its group's), or None."""
    refusals = {r.target: target_mismatch(r.target, r.parameters) for r in records}
    refused_by_group = {r.group: r.target for r in records if r.group and refusals[r.target]}
    for record in records:
        other = refused_by_group.get(record.group)
        if record.group and refusals[record.target] is None and other is not None:
            refusals[record.target] = f"{other} of the {record.group} hooks does not register"
    return refusals


def left_to_sglang(records: list[HookRecord], refusals: dict[str, str | None]) -> str | None:
    """One line naming this sglang's version and every target its own code keeps, with why;
    None where every hook registers."""
    left = [f"{r.target} ({refusals[r.target]})" for r in records if refusals[r.target]]
    if not left:
        return None
    groups = sorted({r.group for r in records if r.group is not None and refusals[r.target]})
    sets = "".join(f"; no {group} hook registers" for group in groups)
    return (
        f"sglang {sglang_version()} (hooks written for {MIRRORED_SGLANG}, supported "
        f"{SUPPORTED_SGLANG}): {len(left)} of {len(records)} targets run sglang's own code{sets}: "
        + "; ".join(left)
    )


def target_mismatch(target: str, expected: Parameters) -> str | None:
    """Why the hook on `target` would not register in this sglang, or None: the target is
    missing, or its parameters or its code are not those of the sglang 0.5.23 it mirrors."""
    try:
        function = pkgutil.resolve_name(target)
    except (ImportError, AttributeError) as error:
        return f"{target} is not in this sglang ({error})"
    found = function_parameters(function)
    if found != expected:
        return f"{target} has parameters {found}, not the {expected} of sglang {MIRRORED_SGLANG}"
    if source_fingerprint(function) != SOURCE_FINGERPRINTS.get(target):
        return f"{target} runs other code than sglang {MIRRORED_SGLANG}'s, which its hook mirrors"
    return None


def function_parameters(function: Callable) -> Parameters:
    """(name, default) of each parameter; `inspect.Parameter.empty` marks no default."""
    return tuple(
        (name, parameter.default)
        for name, parameter in inspect.signature(function).parameters.items()
    )

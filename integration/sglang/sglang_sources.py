"""Which sglang code each hook mirrors: its target's source in sglang 0.5.23, by fingerprint.

A hook replaces, or wraps and extends, one sglang function, so it is right only
for the code it was written against. A matching signature is not enough:
sglang 0.5.20's `send_kvcache_slice` has 0.5.23's parameters and computes the
head slices in its own body. `register` therefore hooks a target only where its
source is 0.5.23's (`SOURCE_FINGERPRINTS`); anywhere else sglang runs its own
code there, and one WARNING names the sglang version and every target left.

The fingerprint is a hash of the function's source lines, with blank and
comment-only lines and indentation dropped: a change of code changes it, a
reflowed comment does not, and it does not depend on the Python version.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable

MIRRORED_SGLANG = "0.5.23"
SUPPORTED_SGLANG = ">=0.5.20,<0.5.24"  # the package's `sglang` extra says the same

_MOONCAKE = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"
_COMMON = "sglang.srt.disaggregation.common.conn.CommonKVManager"
_DECODE_QUEUE = "sglang.srt.disaggregation.decode.DecodePreallocQueue"

# Each hooked target: `source_fingerprint` of it in sglang 0.5.23 (a test checks every hook's
# target against the installed sglang, and prints the line for one missing here).
SOURCE_FINGERPRINTS = {
    f"{_MOONCAKE}._send_kvcache_generic": "856693049c13b228",
    f"{_MOONCAKE}.send_kvcache_slice": "c3ac64e7082bb83e",
    f"{_MOONCAKE}._send_swa_state_slice": "1306cb52d05d78ca",
    "sglang.srt.mem_cache.common.kv_to_page_indices": "ef45d393791bc056",
    f"{_DECODE_QUEUE}.pop_preallocated": "d1f69a38fecbac20",
    f"{_DECODE_QUEUE}._pre_alloc": "32d8bf9058b2a7ca",
    f"{_MOONCAKE}.build_receiver_registration_message": "415839a106c37438",
    f"{_MOONCAKE}.build_receiver_metadata_message": "d44a1bf5d89aae74",
    f"{_COMMON}.handle_chunk_ready": "b7c16971b4f1bb18",
    f"{_COMMON}.parse_kv_status_message": "4046e03e2f0defaf",
    f"{_COMMON}.apply_prefill_status": "e58bf68285bce068",
    f"{_COMMON}.update_status": "1cebab9cebde93f8",
    "sglang.srt.disaggregation.common.conn.CommonKVReceiver.clear": "e7ff61ca1c20d5d3",
    "sglang.srt.disaggregation.mooncake.conn.KVArgsRegisterInfo.from_zmq": "923bef0fc9cb1b5a",
    "sglang.srt.disaggregation.mooncake.conn.TransferInfo.from_zmq": "1252c7a972a61905",
    f"{_COMMON}._encode_kv_status_message": "e41c906f0b074128",
    f"{_COMMON}.try_ensure_parallel_info": "d054ad782d81cbe2",
    "sglang.srt.disaggregation.common.conn.PrefillServerInfo.__post_init__": "42d76659d590213d",
    "sglang.srt.disaggregation.common.conn.CommonKVReceiver.send_metadata": "dc8fdcf38e635f65",
}


def source_fingerprint(function: Callable) -> str | None:
    """A hash of `function`'s source (what hooks wrap unwrapped), or None where it has none."""
    try:
        lines = inspect.getsource(inspect.unwrap(function)).splitlines()
    except (OSError, TypeError):
        return None
    code = [line.strip() for line in lines]
    code = [line for line in code if line and not line.startswith("#")]
    return hashlib.sha256("\n".join(code).encode()).hexdigest()[:16]


def sglang_version() -> str:
    """The version of the sglang package imported here (not of whichever distribution pip has)."""
    import sglang

    return str(getattr(sglang, "__version__", "unknown"))

"""Which GPU errors take a GPU out of service: the Xid tables and the ECC rule.

An Xid is the driver's numbered report of a GPU error (NVML delivers the critical ones as events
of type `nvmlEventTypeXidCriticalError`, the Xid in `eventData`). Like NVIDIA's device plugin, we
act on every critical Xid except the application errors: those are a user's bad kernel or a
process killed mid-flight, the GPU itself is fine, and marking it unhealthy would let one user's
bug take a GPU from everyone. The ignored set is a setting (`gpuHealthIgnoredXids`) whose default
is the device plugin's.

ECC: a double-bit error is uncorrectable (data was lost), so it acts like a critical Xid; a
single-bit error was corrected by the hardware, so it is counted and nothing more (the driver
raises Xid 92 itself when single-bit errors come at a high rate, and that Xid acts).
"""

from __future__ import annotations

# The device plugin's application-error Xids (k8s-device-plugin, `applicationErrorXids`).
DEFAULT_IGNORED_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 109)

# What the well-known Xids mean (NVIDIA's Xid catalogue): the first six are the application errors above; any
# other critical Xid acts too, named by its number.
XID_MEANINGS: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after a previous error",
    68: "video processor exception",
    109: "context switch timeout",
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

# The largest Xid number accepted in settings and by `fake-gpu fault` (today's catalogue ends below 200).
MAX_XID = 9999

# Xid 79: the GPU is off the bus; NVML then answers GPU_IS_LOST for it, so a fake models it as Lost.
FALLEN_OFF_THE_BUS = 79

LOST_REASON = "GPU is lost (NVML_ERROR_GPU_IS_LOST: not answering, e.g. fallen off the bus)"
ECC_DOUBLE_REASON = "double-bit ECC error (uncorrectable)"


def describe_xid(xid: int) -> str:
    """`Xid 48 (double-bit ECC error)`; an Xid without a known meaning is named by its number."""
    meaning = XID_MEANINGS.get(xid)
    return f"Xid {xid} ({meaning})" if meaning else f"Xid {xid}"


def reason_class(reason: str) -> str:
    """The class of error a health reason names, as a GPU health Event states it: `critical Xid` (an Xid that
    acts, `Xid 79 (...)`), `uncorrectable ECC error`, `GPU lost` (NVML's GPU_IS_LOST), else `fault`."""
    if reason.startswith("Xid "):
        return "critical Xid"
    if reason == ECC_DOUBLE_REASON:
        return "uncorrectable ECC error"
    if reason == LOST_REASON:
        return "GPU lost"
    return "fault"


def xid_acts(xid: int, ignored: frozenset[int] | tuple[int, ...] = DEFAULT_IGNORED_XIDS) -> bool:
    """Whether a critical Xid takes the GPU out of service (every Xid not ignored does)."""
    return xid not in ignored


def parse_xids(text: str) -> tuple[int, ...]:
    """`13,31, 43` -> (13, 31, 43), sorted and without repeats; ValueError (its message says what is wrong)
    on anything else. An empty text is the empty list."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not (part.isascii() and part.isdigit() and len(part) <= 6) or not 1 <= int(part) <= MAX_XID:
            raise ValueError(f"{part[:20]!r} is not an Xid number between 1 and {MAX_XID}")
        out.add(int(part))
    return tuple(sorted(out))

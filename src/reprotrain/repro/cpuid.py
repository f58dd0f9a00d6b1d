"""The CPU as the ``cpuid`` instruction describes it: vendor, family, model, name, ISA flags.

Also the one reader of ``/proc/cpuinfo``, the fallback; neither imports torch.

Closes (as a record): a CPU identity read from a file that may not describe the CPU the
code runs on. ``/proc/cpuinfo`` is the kernel's view of the host: under an emulator
(``qemu-x86_64 -cpu Haswell``) or a container that mounts another file there, it names a
CPU the kernels never dispatched on. The instruction is what the libraries themselves ask
(oneDNN, MKL and ATen dispatch on it), so the identity prefers it.

x86-64 Linux only: 28 bytes of machine code in an executable anonymous mapping, called
through ctypes. Where that is not possible (another architecture, a system that refuses
executable memory), :func:`read` returns None and the caller falls back to
``/proc/cpuinfo``. The flag names are the Linux kernel's (``/proc/cpuinfo``), so both
sources give the same identity on a real host.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import platform
import struct
from pathlib import Path
from typing import Any

# push rbx; mov r8, rdx; mov eax, edi; mov ecx, esi; cpuid;
# mov [r8], eax; mov [r8+4], ebx; mov [r8+8], ecx; mov [r8+12], edx; pop rbx; ret
# (System V: leaf in edi, subleaf in esi, the 16-byte result buffer in rdx.)
_CODE = bytes.fromhex("534989d089f889f10fa241890041895804418948084189500c5bc3")

#: (leaf, subleaf, register, bit) -> the kernel's flag name, for the flags the CPU kernel
#: libraries dispatch on (``cpu_identity.X86_DISPATCH_FLAGS``).
FLAGS: dict[tuple[int, int, str, int], str] = {
    (1, 0, "ecx", 12): "fma",
    (1, 0, "ecx", 29): "f16c",
    (7, 0, "ebx", 5): "avx2",
    (7, 0, "ebx", 16): "avx512f",
    (7, 0, "ebx", 17): "avx512dq",
    (7, 0, "ebx", 21): "avx512ifma",
    (7, 0, "ebx", 26): "avx512pf",
    (7, 0, "ebx", 27): "avx512er",
    (7, 0, "ebx", 28): "avx512cd",
    (7, 0, "ebx", 30): "avx512bw",
    (7, 0, "ebx", 31): "avx512vl",
    (7, 0, "ecx", 1): "avx512vbmi",
    (7, 0, "ecx", 6): "avx512_vbmi2",
    (7, 0, "ecx", 11): "avx512_vnni",
    (7, 0, "ecx", 12): "avx512_bitalg",
    (7, 0, "ecx", 14): "avx512_vpopcntdq",
    (7, 0, "edx", 2): "avx512_4vnniw",
    (7, 0, "edx", 3): "avx512_4fmaps",
    (7, 0, "edx", 8): "avx512_vp2intersect",
    (7, 0, "edx", 22): "amx_bf16",
    (7, 0, "edx", 23): "avx512_fp16",
    (7, 0, "edx", 24): "amx_tile",
    (7, 0, "edx", 25): "amx_int8",
    (7, 1, "eax", 4): "avx_vnni",
    (7, 1, "eax", 5): "avx512_bf16",
    (7, 1, "eax", 21): "amx_fp16",
}
_REGS = ("eax", "ebx", "ecx", "edx")


@functools.cache
def _instruction() -> Any:
    """The callable ``cpuid(leaf, subleaf, out)``, or None where it cannot be made."""
    if platform.machine().lower() not in ("x86_64", "amd64") or platform.system() != "Linux":
        return None
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, ValueError, AttributeError):  # executable memory refused
        return None
    page.write(_CODE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    proto = ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p)
    func = proto(address)
    func._page = page  # the mapping lives as long as the function
    return func


def registers(leaf: int, subleaf: int = 0) -> dict[str, int] | None:
    """eax, ebx, ecx, edx of ``cpuid`` for ``(leaf, subleaf)``; None without the instruction."""
    func = _instruction()
    if func is None:
        return None
    out = (ctypes.c_uint32 * 4)()
    func(leaf, subleaf, ctypes.addressof(out))
    return dict(zip(_REGS, out, strict=True))


def decode(ask: Any) -> dict[str, Any]:
    """The identity fields from a register reader ``ask(leaf, subleaf) -> {reg: int}``.

    Pure, so a test can feed it documented register values. Family and model follow the
    vendors' rule for the displayed values (extended family added when the base is 0xF,
    extended model prepended for families 6 and 0xF), as the kernel prints them.
    """
    top = ask(0, 0)
    vendor = struct.pack("<III", top["ebx"], top["edx"], top["ecx"]).decode("ascii", "replace")
    sig = ask(1, 0)["eax"]
    base_family, base_model = (sig >> 8) & 0xF, (sig >> 4) & 0xF
    family = base_family + ((sig >> 20) & 0xFF if base_family == 0xF else 0)
    model = base_model | (((sig >> 16) & 0xF) << 4 if base_family in (0x6, 0xF) else 0)
    words: dict[tuple[int, int], dict[str, int]] = {}
    max_leaf, sub7 = top["eax"], 0
    for leaf, subleaf in sorted({(k[0], k[1]) for k in FLAGS}):
        if leaf > max_leaf or (leaf == 7 and subleaf > sub7):
            continue
        words[(leaf, subleaf)] = ask(leaf, subleaf)
        if (leaf, subleaf) == (7, 0):
            sub7 = words[(7, 0)]["eax"]
    flags = sorted(
        name
        for (leaf, subleaf, reg, bit), name in FLAGS.items()
        if (leaf, subleaf) in words and words[(leaf, subleaf)][reg] >> bit & 1
    )
    return {
        "vendor": vendor,
        "family": str(family),
        "model": str(model),
        "stepping": str(sig & 0xF),
        "model_name": _brand(ask),
        "isa_flags": flags,
    }


def _brand(ask: Any) -> str | None:
    if ask(0x80000000, 0)["eax"] < 0x80000004:
        return None
    raw = b"".join(
        struct.pack("<IIII", *(r[k] for k in _REGS))
        for r in (ask(leaf, 0) for leaf in (0x80000002, 0x80000003, 0x80000004))
    )
    return raw.split(b"\0", 1)[0].decode("ascii", "replace").strip() or None


def proc_cpuinfo() -> str:
    """The text of ``/proc/cpuinfo`` ("" where there is none): the one place it is read."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def read() -> dict[str, Any] | None:
    """This CPU's identity fields from the instruction itself, or None where it cannot run."""
    if _instruction() is None:
        return None
    return decode(registers)

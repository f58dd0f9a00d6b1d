"""What makes two CPUs "the same CPU for bits": the identity the comparability rule compares.

Closes (as a record): CPU kernel dispatch. torch's ATen kernels, oneDNN (convolutions,
some matmuls) and MKL (GEMM) each pick a code path for the CPU they run on, and each path
rounds differently. torch's capability label is not enough: an AMD EPYC and an Intel Xeon
both report ``AVX512`` and trained the same smoke config to different bits (issue 24), because
oneDNN dispatches on the AVX-512 subsets and AMX, and MKL on the vendor. So the record holds
the CPU's vendor, family/model/stepping and model name, the ISA extensions the libraries
dispatch on, what each library really chose (torch's capability, oneDNN's ISA, MKL's
conditional-numerical-reproducibility branch, read back from the libraries), their versions,
and the variables that steer them.

``portable`` is read back too: True when every lever of ``repro=portable`` (``PORTABLE_ENV``)
is in force, so a record says whether its CPU math ran on the paths every x86-64 CPU with
AVX2 runs alike. Which of these fields must match is decided in ``repro/comparability.py``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from reprotrain.repro import cpuid
from reprotrain.repro.hashseed import PORTABLE_CONFLICTS, PORTABLE_ENV

#: Variables that steer which CPU kernels run (ATen, oneDNN, MKL). Recorded, None when unset,
#: and compared. The thread pools' sizes (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``: the
#: reduction order) are compared as the thread count that ran, read back from torch, not as
#: variables: torchrun sets ``OMP_NUM_THREADS=1`` in its workers, so a world-size-invariant
#: run on 2 processes and its re-run on 1 differ in the variable and not in the threads.
#: They are in the environment record (``environment.ENV_ALLOWLIST``) and shown as notes.
DISPATCH_ENV_VARS = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
)

#: What the libraries report when PORTABLE_ENV is in force.
PORTABLE_READBACK = {"capability": "AVX2", "mkl_cbwr_branch": "COMPATIBLE"}

#: /proc/cpuinfo flags the kernel libraries dispatch on: on x86 (``flags``) AVX2, FMA, F16C,
#: the AVX-512 subsets and AMX; on aarch64 (``Features``) NEON, SVE, SME, bf16, int8 matmul.
X86_DISPATCH_FLAGS = re.compile(r"^(avx2|avx_vnni.*|fma|f16c|avx512.*|amx.*)$")
ARM_DISPATCH_FLAGS = re.compile(r"^(asimd.*|sve.*|sme.*|bf16|i8mm)$")

# mkl_cbwr.h: the branch codes mkl_cbwr_get(MKL_CBWR_BRANCH) returns.
_MKL_BRANCHES = {
    0: "OFF",
    1: "BRANCH_OFF",
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    11: "AVX512_MIC",
    12: "AVX512",
    13: "AVX512_MIC_E1",
    14: "AVX512_E1",
}
_MKL_STRICT = 0x10000


def cpu_fields() -> dict[str, Any]:
    """Vendor, family, model, stepping, model name and dispatch flags of this CPU, with
    ``source``: from the ``cpuid`` instruction where it can run (x86-64 Linux), which is
    what the kernel libraries dispatch on, else from ``/proc/cpuinfo`` (the kernel's view,
    which an emulator or a mounted file can make another CPU's), else from ``platform``."""
    fields = cpuid.read()
    if fields is not None:
        return {**fields, "source": "cpuid"}
    return {**cpuinfo_fields(), "source": "/proc/cpuinfo"}


def cpuinfo_fields(text: str | None = None) -> dict[str, Any]:
    """Vendor, family, model, stepping, model name and dispatch flags of the first CPU in
    ``/proc/cpuinfo`` (Linux); on other systems what ``platform`` knows, the rest None."""
    if text is None:
        text = cpuid.proc_cpuinfo()
    if not text and platform.system() == "Darwin":
        return _macos_fields()
    first: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if first:
                break
            continue
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    if "flags" in first:  # x86
        flags, wanted = first["flags"], X86_DISPATCH_FLAGS
    else:  # aarch64
        flags, wanted = first.get("Features", ""), ARM_DISPATCH_FLAGS
    return {
        "vendor": first.get("vendor_id") or first.get("CPU implementer") or None,
        "family": first.get("cpu family") or first.get("CPU architecture") or None,
        "model": first.get("model") or first.get("CPU part") or None,
        "stepping": first.get("stepping") or first.get("CPU revision") or None,
        "model_name": first.get("model name") or platform.processor() or None,
        "isa_flags": sorted(f for f in flags.split() if wanted.match(f)),
    }


def _macos_fields() -> dict[str, Any]:
    """macOS has no /proc/cpuinfo: the brand string (``Apple M2 Pro``) names the model."""
    import subprocess

    def sysctl(name: str) -> str | None:
        try:
            out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True,
                                 timeout=10)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() or None if out.returncode == 0 else None

    return {
        "vendor": "Apple" if platform.machine() == "arm64" else sysctl("machdep.cpu.vendor"),
        "family": sysctl("hw.cpufamily"),
        "model": sysctl("hw.model"),
        "stepping": None,
        "model_name": sysctl("machdep.cpu.brand_string"),
        "isa_flags": [],
    }


def _libtorch_cpu() -> ctypes.CDLL | None:
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        return ctypes.CDLL(str(lib)) if lib.is_file() else None
    except OSError:
        return None


def mkl_version() -> str | None:
    """MKL's own version string (the library linked into torch), or None without MKL."""
    lib = _libtorch_cpu()
    get = getattr(lib, "MKL_Get_Version_String", None) if lib is not None else None
    if get is None:
        return _config_line(r"Math Kernel Library Version (\S+)")
    buf = ctypes.create_string_buffer(256)
    get(buf, len(buf))
    return buf.value.decode(errors="replace").strip() or None


def mkl_cbwr_branch() -> str | None:
    """The CNR branch MKL really uses (``MKL_CBWR`` as MKL read it: a branch MKL cannot
    honour on this CPU reads back as AUTO). None where torch has no MKL."""
    lib = _libtorch_cpu()
    get = getattr(lib, "mkl_serv_cbwr_get", None) if lib is not None else None
    if get is None:
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    code = int(get(1))  # MKL_CBWR_BRANCH
    name = _MKL_BRANCHES.get(code & ~_MKL_STRICT, f"code {code & ~_MKL_STRICT}")
    return name + (",STRICT" if code & _MKL_STRICT else "")


def _config_line(pattern: str) -> str | None:
    match = re.search(pattern, torch.__config__.show())
    return match.group(1) if match else None


def onednn_version() -> str | None:
    """oneDNN's version and commit as torch was built with it (``v3.12.0 (Git Hash ...)``)."""
    if not torch.backends.mkldnn.is_available():
        return None
    return _config_line(r"MKL-DNN (v[^\n]+?)\s*\n")


@functools.cache
def onednn_isa() -> str | None:
    """The ISA oneDNN dispatches to, as its verbose header names it (``Intel AVX2``).

    oneDNN prints the header on stdout when verbose mode first creates a primitive; one
    convolution of zeros (no random number drawn) under ``torch.backends.mkldnn.verbose``
    with stdout redirected to a file reads it. Cached: the header is printed once a process.
    """
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return None
    x, w = torch.zeros(8, 16, 32, 32), torch.zeros(16, 16, 3, 3)
    with tempfile.TemporaryFile() as out:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            with torch.no_grad(), torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                torch.nn.functional.conv2d(x, w, padding=1)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")
    match = re.search(r"onednn_verbose,(?:v\d+,)?info,cpu,isa:([^\n]+)", text)
    return match.group(1).strip() if match else None


def dispatch_env() -> dict[str, str | None]:
    """The dispatch variables as this process sees them (None: unset)."""
    return {name: os.environ.get(name) for name in DISPATCH_ENV_VARS}


def portable_in_force(identity: dict[str, Any]) -> bool:
    """True when every lever of repro=portable is set and read back by the libraries."""
    env = identity.get("dispatch_env") or {}
    levers = all(env.get(k) == v for k, v in PORTABLE_ENV.items())
    readback = all(identity.get(k) == v for k, v in PORTABLE_READBACK.items())
    onednn = identity.get("onednn_isa")
    onednn_capped = onednn is None or onednn.endswith("AVX2")
    no_conflict = all(env.get(name) is None for name in PORTABLE_CONFLICTS)
    return levers and readback and onednn_capped and no_conflict


def capture() -> dict[str, Any]:
    """The CPU identity of this process, for run.json ``environment.cpu``."""
    cpu = cpu_fields()
    identity = {
        "name": cpu["model_name"] or platform.machine(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        **cpu,
        "onednn_isa": onednn_isa(),
        "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
        "mkl_version": mkl_version() if torch.backends.mkl.is_available() else None,
        "mkl_cbwr_branch": mkl_cbwr_branch() if torch.backends.mkl.is_available() else None,
        "onednn_version": onednn_version(),
        "dispatch_env": dispatch_env(),
    }
    identity["portable"] = portable_in_force(identity)
    return identity

"""What machine is this: the CPU and the GPU as far as they decide the bits.
Closes (as records): CPU kernel dispatch and GPU kernel choice (docs/gpus.md; why no
library: docs/design.md, "Large rooms"). No torch at module level: ``hashseed`` reads
:func:`cpu_flags` before torch loads. Which fields must match: ``repro/comparability.py``."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# push rbx; mov r8, rdx; mov eax, edi; mov ecx, esi; cpuid;
# mov [r8], eax; mov [r8+4], ebx; mov [r8+8], ecx; mov [r8+12], edx; pop rbx; ret
# (System V: leaf in edi, subleaf in esi, the 16-byte result buffer in rdx.)
_CODE = bytes.fromhex("534989d089f889f10fa241890041895804418948084189500c5bc3")

#: (leaf, subleaf, register) -> "bit:flag ..." for the flags the CPU kernel libraries
#: dispatch on (``X86_DISPATCH_FLAGS``), by the kernel's flag names.
_CPUID_BITS = {
    (1, 0, "ecx"): "12:fma 29:f16c",
    (7, 0, "ebx"): "5:avx2 16:avx512f 17:avx512dq 21:avx512ifma 26:avx512pf 27:avx512er "
    "28:avx512cd 30:avx512bw 31:avx512vl",
    (7, 0, "ecx"): "1:avx512vbmi 6:avx512_vbmi2 11:avx512_vnni 12:avx512_bitalg "
    "14:avx512_vpopcntdq",
    (7, 0, "edx"): "2:avx512_4vnniw 3:avx512_4fmaps 8:avx512_vp2intersect 22:amx_bf16 "
    "23:avx512_fp16 24:amx_tile 25:amx_int8",
    (7, 1, "eax"): "4:avx_vnni 5:avx512_bf16 21:amx_fp16",
}
#: (leaf, subleaf, register, bit) -> flag name.
CPUID_FLAGS: dict[tuple[int, int, str, int], str] = {
    (*word, int(bit)): name
    for word, table in _CPUID_BITS.items()
    for bit, name in (item.split(":") for item in table.split())
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
    func = ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p)(address)
    func._page = page  # the mapping lives as long as the function
    return func


def registers(leaf: int, subleaf: int = 0) -> dict[str, int] | None:
    """eax, ebx, ecx, edx of ``cpuid`` for ``(leaf, subleaf)``; None without the instruction."""
    if (func := _instruction()) is None:
        return None
    out = (ctypes.c_uint32 * 4)()
    func(leaf, subleaf, ctypes.addressof(out))
    return dict(zip(_REGS, out, strict=True))


def decode_cpuid(ask: Any) -> dict[str, Any]:
    """The identity fields from a register reader ``ask(leaf, subleaf) -> {reg: int}`` (pure:
    tests feed it documented values). Family and model as the kernel displays them."""
    top = ask(0, 0)
    vendor = struct.pack("<III", top["ebx"], top["edx"], top["ecx"]).decode("ascii", "replace")
    sig = ask(1, 0)["eax"]
    base_family, base_model = (sig >> 8) & 0xF, (sig >> 4) & 0xF
    family = base_family + ((sig >> 20) & 0xFF if base_family == 0xF else 0)
    model = base_model | (((sig >> 16) & 0xF) << 4 if base_family in (0x6, 0xF) else 0)
    words: dict[tuple[int, int], dict[str, int]] = {}
    max_leaf, sub7 = top["eax"], 0
    for leaf, subleaf in sorted({(k[0], k[1]) for k in CPUID_FLAGS}):
        if leaf > max_leaf or (leaf == 7 and subleaf > sub7):
            continue
        words[(leaf, subleaf)] = ask(leaf, subleaf)
        if (leaf, subleaf) == (7, 0):
            sub7 = words[(7, 0)]["eax"]
    flags = sorted(
        name
        for (leaf, subleaf, reg, bit), name in CPUID_FLAGS.items()
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


@functools.cache
def cpuid_fields() -> dict[str, Any] | None:
    """This CPU's identity fields from the instruction itself, or None where it cannot run."""
    return None if _instruction() is None else decode_cpuid(registers)


#: Variables that steer which CPU kernels run (ATen, oneDNN, MKL): recorded (None when unset)
#: and compared. Thread pools are compared as torch's thread count (torchrun sets
#: ``OMP_NUM_THREADS=1`` in its workers).
_DISPATCH_VARS = (
    "ATEN_CPU_CAPABILITY ONEDNN_MAX_CPU_ISA DNNL_MAX_CPU_ISA MKL_CBWR MKL_ENABLE_INSTRUCTIONS"
)
DISPATCH_ENV_VARS = tuple(_DISPATCH_VARS.split())
#: repro=portable: the code paths every x86-64 CPU with AVX2 runs alike (README, "Determinism
#: levels"). MKL's CNR branch is COMPATIBLE: on AMD, MKL reads MKL_CBWR=AVX2 back as AUTO.
PORTABLE_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_CBWR": "COMPATIBLE",
}
#: Set by the user, these would steer dispatch around the portable levers: refused.
PORTABLE_CONFLICTS = ("DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
#: What the libraries report when PORTABLE_ENV is in force.
PORTABLE_READBACK = {"capability": "AVX2", "mkl_cbwr_branch": "COMPATIBLE"}

#: /proc/cpuinfo flags the kernel libraries dispatch on: on x86 (``flags``) AVX2, FMA, F16C,
#: the AVX-512 subsets and AMX; on aarch64 (``Features``) NEON, SVE, SME, bf16, int8 matmul.
X86_DISPATCH_FLAGS = re.compile(r"^(avx2|avx_vnni.*|fma|f16c|avx512.*|amx.*)$")
ARM_DISPATCH_FLAGS = re.compile(r"^(asimd.*|sve.*|sme.*|bf16|i8mm)$")

# mkl_cbwr.h: the branch codes mkl_cbwr_get(MKL_CBWR_BRANCH) returns.
_BRANCH_CODES = (
    "0:OFF 1:BRANCH_OFF 2:AUTO 3:COMPATIBLE 4:SSE2 6:SSSE3 7:SSE4_1 8:SSE4_2 9:AVX 10:AVX2 "
    "11:AVX512_MIC 12:AVX512 13:AVX512_MIC_E1 14:AVX512_E1"
)
_MKL_BRANCHES = {int(code): name for code, name in (c.split(":") for c in _BRANCH_CODES.split())}
_MKL_STRICT = 0x10000


def proc_cpuinfo() -> str:
    """The text of ``/proc/cpuinfo`` ("" where there is none): the one place it is read."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_fields() -> dict[str, Any]:
    """This CPU's identity fields, with ``source``: ``cpuid`` where it runs, else /proc/cpuinfo."""
    if (fields := cpuid_fields()) is not None:
        return {**fields, "source": "cpuid"}
    return {**cpuinfo_fields(), "source": "/proc/cpuinfo"}


def cpu_flags() -> set | None:
    """The CPU's dispatch flags (``cpuid``, else every /proc/cpuinfo flag; None: unknown)."""
    if (fields := cpuid_fields()) is not None:
        return set(fields["isa_flags"])
    for line in proc_cpuinfo().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def cpuinfo_fields(text: str | None = None) -> dict[str, Any]:
    """The identity fields of the first CPU in /proc/cpuinfo (else what ``platform`` knows)."""
    if text is None:
        text = proc_cpuinfo()
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

    def sysctl(name: str) -> str | None:
        return (_stdout(["sysctl", "-n", name], timeout=10) or "").strip() or None

    return {
        "vendor": "Apple" if platform.machine() == "arm64" else sysctl("machdep.cpu.vendor"),
        "family": sysctl("hw.cpufamily"),
        "model": sysctl("hw.model"),
        "stepping": None,
        "model_name": sysctl("machdep.cpu.brand_string"),
        "isa_flags": [],
    }


def _libtorch_cpu(symbol: str) -> Any:
    """``symbol`` of torch's libtorch_cpu.so (MKL is linked into it), or None."""
    import torch

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        return getattr(ctypes.CDLL(str(lib)), symbol, None) if lib.is_file() else None
    except OSError:
        return None


def mkl_version() -> str | None:
    """MKL's own version string (the library linked into torch), or None without MKL."""
    if (get := _libtorch_cpu("MKL_Get_Version_String")) is None:
        return _config_line(r"Math Kernel Library Version (\S+)")
    buf = ctypes.create_string_buffer(256)
    get(buf, len(buf))
    return buf.value.decode(errors="replace").strip() or None


def mkl_cbwr_branch() -> str | None:
    """The CNR branch MKL really uses (one it cannot honour reads back as AUTO); None: no MKL."""
    if (get := _libtorch_cpu("mkl_serv_cbwr_get")) is None:
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    code = int(get(1))  # MKL_CBWR_BRANCH
    name = _MKL_BRANCHES.get(code & ~_MKL_STRICT, f"code {code & ~_MKL_STRICT}")
    return name + (",STRICT" if code & _MKL_STRICT else "")


def _config_line(pattern: str) -> str | None:
    import torch

    match = re.search(pattern, torch.__config__.show())
    return match.group(1) if match else None


def onednn_version() -> str | None:
    """oneDNN's version and commit as torch was built with it (``v3.12.0 (Git Hash ...)``)."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return None
    return _config_line(r"MKL-DNN (v[^\n]+?)\s*\n")


@functools.cache
def onednn_isa() -> str | None:
    """The ISA oneDNN dispatches to (``Intel AVX2``), from its verbose header around one
    convolution of zeros (no random draw). Cached: the header is printed once a process."""
    import torch

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


def portable_in_force(identity: dict[str, Any]) -> bool:
    """True when every lever of repro=portable is set and read back by the libraries."""
    env = identity.get("dispatch_env") or {}
    levers = all(env.get(k) == v for k, v in PORTABLE_ENV.items())
    readback = all(identity.get(k) == v for k, v in PORTABLE_READBACK.items())
    onednn = identity.get("onednn_isa")
    onednn_capped = onednn is None or onednn.endswith("AVX2")
    no_conflict = all(env.get(name) is None for name in PORTABLE_CONFLICTS)
    return levers and readback and onednn_capped and no_conflict


def capture_cpu() -> dict[str, Any]:
    """The CPU identity of this process, for run.json ``environment.cpu``."""
    import torch

    cpu = cpu_fields()
    mkl = torch.backends.mkl.is_available()
    identity = {
        "name": cpu["model_name"] or platform.machine(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        **cpu,
        "onednn_isa": onednn_isa(),
        "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
        "mkl_version": mkl_version() if mkl else None,
        "mkl_cbwr_branch": mkl_cbwr_branch() if mkl else None,
        "onednn_version": onednn_version(),
        "dispatch_env": {name: os.environ.get(name) for name in DISPATCH_ENV_VARS},
    }
    identity["portable"] = portable_in_force(identity)
    return identity


#: The GPU block's keys; all None on a CPU run, so "absent" is never "not recorded".
_GPU_KEYS = (
    "index name uuid compute_capability sm_count total_memory_bytes mig_mode driver_version "
    "driver_cuda_version visible_devices blas_library cublas_workspace_bytes "
    "cublaslt_workspace_bytes memory_free_at_start_bytes memory_total_at_start_bytes"
)
GPU_FIELDS = tuple(_GPU_KEYS.split())


def indexed(device: Any) -> Any:
    """``cuda`` with its ordinal made explicit (``cuda:0``); other devices as given."""
    import torch

    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_info(device: Any) -> dict[str, Any]:
    """Short device identity (type, resolved name, model, capability) for ids and reports."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "resolved": str(indexed(device)),
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
        }
    return {
        "type": device.type,
        "resolved": device.type,
        "name": cpu_fields()["model_name"] or platform.processor() or platform.machine(),
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def nvidia_smi(*args: str) -> str | None:
    """stdout of ``nvidia-smi args`` or None (not on PATH, failed, or hung)."""
    return _stdout(["nvidia-smi", *args], timeout=20)


def _stdout(argv: list[str], timeout: float) -> str | None:
    """stdout of ``argv`` or None (not on PATH, failed, or hung)."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _bare_uuid(uuid: str) -> str:
    return uuid.lower().removeprefix("gpu-").removeprefix("mig-")


def _smi_row(uuid: str) -> dict[str, str | None]:
    """Driver version and MIG mode of the GPU with this UUID, per nvidia-smi."""
    out = nvidia_smi("--query-gpu=uuid,driver_version,mig.mode.current", "--format=csv,noheader")
    rows = [[c.strip() for c in line.split(",")] for line in (out or "").splitlines()]
    rows = [r for r in rows if len(r) == 3]
    if not rows:
        return {"driver_version": None, "mig_mode": None}
    # The driver is one per host; MIG mode belongs to the physical GPU (a MIG slice's own
    # UUID is not listed here, so no match leaves it unknown unless the env says MIG).
    match = next((r for r in rows if _bare_uuid(r[0]) == _bare_uuid(uuid)), None)
    mig = match[2] if match and match[2] not in ("[N/A]", "N/A") else None
    return {"driver_version": rows[0][1], "mig_mode": mig}


def driver_cuda_version() -> str | None:
    """The CUDA version the driver supports ("13.0"), from torch when it exposes it."""
    import torch

    if (get := getattr(torch._C, "_cuda_getDriverVersion", None)) is None:
        return None
    try:
        v = int(get())
    except (RuntimeError, TypeError, ValueError):
        return None
    return f"{v // 1000}.{(v % 1000) // 10}" if v > 0 else None


def blas_info() -> dict[str, Any]:
    """The BLAS library and workspace sizes torch will really use (CUDA runs only)."""
    import torch

    b = torch.backends.cuda
    out: dict[str, Any] = {}
    for key, get in (
        ("blas_library", lambda: str(b.preferred_blas_library()).rsplit(".", 1)[-1]),
        ("cublas_workspace_bytes", lambda: int(b.cublas_workspace_size())),
        ("cublaslt_workspace_bytes", lambda: int(b.cublaslt_workspace_size())),
    ):
        try:
            out[key] = get()
        except (AttributeError, RuntimeError):
            out[key] = None
    return out


def capture_gpu(device: Any) -> dict[str, Any]:
    """The training GPU's identity and free memory now; every value None off CUDA."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return dict.fromkeys(GPU_FIELDS)
    device = indexed(device)
    props = torch.cuda.get_device_properties(device)
    uuid = str(props.uuid)
    smi = _smi_row(uuid)
    mig = smi["mig_mode"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if mig is None and (uuid.startswith("MIG-") or "MIG-" in visible):
        mig = "Enabled"
    free, total = torch.cuda.mem_get_info(device)
    return {
        "index": device.index,
        "name": props.name,
        "uuid": uuid,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": int(props.multi_processor_count),
        "total_memory_bytes": int(props.total_memory),
        "mig_mode": mig,
        "driver_version": smi["driver_version"],
        "driver_cuda_version": driver_cuda_version(),
        "visible_devices": torch.cuda.device_count(),
        **blas_info(),
        "memory_free_at_start_bytes": int(free),
        "memory_total_at_start_bytes": int(total),
    }


def reduced_precision_flags() -> dict[str, bool]:
    """Whether cuBLAS may reduce fp16/bf16 GEMMs in reduced precision (AMP bits on CUDA)."""
    import torch

    m = torch.backends.cuda.matmul
    return {
        "fp16_reduced_precision_reduction": bool(m.allow_fp16_reduced_precision_reduction),
        "bf16_reduced_precision_reduction": bool(m.allow_bf16_reduced_precision_reduction),
    }

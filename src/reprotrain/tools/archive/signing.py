"""SSH signatures over an archive's manifest: ``ssh-keygen -Y sign/verify``, as git uses them.

Closes: an edited archive with a regenerated ``MANIFEST.sha256``. Namespace
``reprotrain-archive``; verified against an OpenSSH allowed-signers file. docs/guarantees.md.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from reprotrain.errors import SigningError

NAMESPACE = "reprotrain-archive"
SIGNATURE_SUFFIX = ".sig"


def ssh_keygen() -> str:
    found = shutil.which("ssh-keygen")
    if found is None:
        raise SigningError("ssh-keygen not found; install OpenSSH (8.2 or newer) to sign/verify")
    return found


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def sign_file(path: Path, key: Path) -> Path:
    """Sign ``path`` with ``key`` (or its public half, via ssh-agent); returns ``<path>.sig``."""
    key = Path(key).expanduser()
    if not key.is_file():
        raise SigningError(f"signing key {key}: no such file")
    sig = Path(f"{path}{SIGNATURE_SUFFIX}")
    sig.unlink(missing_ok=True)
    argv = [ssh_keygen(), "-Y", "sign", "-f", str(key), "-n", NAMESPACE, str(path)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if out.returncode != 0 or not sig.is_file():
        raise SigningError(f"signing with {key} failed: {_last_line(out.stderr)}")
    return sig


@dataclass
class Verified:
    principal: str
    message: str  # ssh-keygen's "Good ... signature for <principal> with <key> SHA256:..."


def verify_bytes(data: bytes, signature: bytes, allowed_signers: Path) -> Verified:
    """Check ``signature`` over ``data`` against ``allowed_signers``; SigningError if not good."""
    allowed = Path(allowed_signers).expanduser()
    if not allowed.is_file():
        raise SigningError(f"trusted signers file {allowed}: no such file")
    keygen = ssh_keygen()
    with tempfile.TemporaryDirectory(prefix="reprotrain-sig-") as tmp:
        sig = Path(tmp) / "manifest.sig"
        sig.write_bytes(signature)
        find = [keygen, "-Y", "find-principals", "-s", str(sig), "-f", str(allowed)]
        found = subprocess.run(find, capture_output=True, text=True, timeout=60)
        principals = [p for p in found.stdout.split() if p]
        if found.returncode != 0 or not principals:
            raise SigningError(f"the archive's signing key is not in {allowed}")
        last = "no message"
        check = [keygen, "-Y", "verify", "-f", str(allowed), "-n", NAMESPACE, "-s", str(sig)]
        for principal in principals:
            argv = [*check, "-I", principal]
            out = subprocess.run(argv, input=data, capture_output=True, timeout=60)
            text = (out.stdout + out.stderr).decode(errors="replace")
            if out.returncode == 0:
                return Verified(principal, _last_line(text))
            last = _last_line(text)
    raise SigningError(f"the archive's signature does not verify against {allowed}: {last}")

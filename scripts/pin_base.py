"""Resolve the base image tag in docker/base-image.env to a digest and write BASE_DIGEST.

`make pin-base` runs this. It asks the registry through the docker client
(`docker buildx imagetools inspect`, else `docker manifest inspect --verbose`). When neither
answers (no network, no registry access, no docker) it prints one `error:` line, writes
nothing and exits 1: a digest is only ever written after a registry returned it.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
ENV_FILE = Path(__file__).resolve().parents[1] / "docker" / "base-image.env"


def read_env(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of the base-image file (comments and blanks ignored)."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def _run(cmd: list[str]) -> tuple[int, str, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        return 127, "", f"{cmd[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", "timed out after 60 s"
    return proc.returncode, proc.stdout, proc.stderr


def _arch() -> str:
    m = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(m, m)


def resolve(docker: str, image: str) -> tuple[str | None, str]:
    """(digest, reason). The multi-arch index digest when buildx is there, else this arch's."""
    rc, out, err = _run([docker, "buildx", "imagetools", "inspect", image, "--format",
                         "{{json .Manifest}}"])  # fmt: skip
    reasons = []
    if rc == 0:
        try:
            digest = json.loads(out).get("digest", "")
        except (ValueError, AttributeError):
            digest = ""
        if DIGEST_RE.match(digest):
            return digest, ""
        reasons.append("buildx: unexpected output")
    else:
        reasons.append("buildx: " + (err.strip().splitlines() or ["failed"])[-1])
    rc, out, err = _run([docker, "manifest", "inspect", "--verbose", image])
    if rc == 0:
        try:
            data = json.loads(out)
        except ValueError:
            data = None
        entries = data if isinstance(data, list) else [data] if isinstance(data, dict) else []
        for entry in entries:
            desc = entry.get("Descriptor", {}) if isinstance(entry, dict) else {}
            plat = desc.get("platform") or {}
            if len(entries) > 1 and (plat.get("os"), plat.get("architecture")) != (
                "linux",
                _arch(),
            ):
                continue
            digest = desc.get("digest", "")
            if DIGEST_RE.match(digest):
                return digest, ""
        reasons.append("manifest: no digest for linux/" + _arch())
    else:
        reasons.append("manifest: " + (err.strip().splitlines() or ["failed"])[-1])
    return None, "; ".join(r[:160] for r in reasons)


def write_digest(path: Path, digest: str) -> None:
    """Replace (or append) the BASE_DIGEST line, keeping everything else byte for byte."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    new = f"BASE_DIGEST={digest}\n"
    for i, line in enumerate(lines):
        if line.strip().startswith("BASE_DIGEST="):
            lines[i] = new
            break
    else:
        lines.append(new)
    path.write_text("".join(lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-file", type=Path, default=ENV_FILE)
    parser.add_argument("--docker", default="docker", help="docker client to use")
    args = parser.parse_args(argv)
    env = read_env(args.env_file)
    image = env.get("BASE_IMAGE", "")
    if not image:
        print(f"error: no BASE_IMAGE in {args.env_file}")
        return 1
    digest, reason = resolve(args.docker, image)
    if digest is None:
        print(
            f"error: could not resolve {image} to a digest (registry unreachable? {reason}); "
            f"{args.env_file.name} left unchanged"
        )
        return 1
    write_digest(args.env_file, digest)
    print(f"ok: {image}@{digest} written to {args.env_file}; commit it")
    return 0


if __name__ == "__main__":
    sys.exit(main())

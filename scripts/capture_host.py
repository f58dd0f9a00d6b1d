"""Print this host's CPU identity as a tests/hosts/<id>.json file (the test matrix's data).

    python scripts/capture_host.py --id amd-epyc-zen5 --how "captured natively ..." > f.json
    qemu-x86_64 -cpu Haswell-v4 .venv/bin/python scripts/capture_host.py --id ... --emulated

It records what reprotrain reads to know a CPU (``repro/machine.capture_cpu``): the
``cpuid`` fields, the first block of ``/proc/cpuinfo``, torch's capability, oneDNN's ISA,
MKL's version and CNR branch, oneDNN's version. Under ``qemu-user`` /proc/cpuinfo is the
host's, so ``--emulated`` writes the block from the emulated CPU's ``cpuid`` instead (and
says so). Pinned hashes are added by hand, from runs on that host.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from reprotrain.repro import machine


def cpuinfo_block(fields: dict) -> str:
    """A /proc/cpuinfo first block holding what reprotrain reads of it."""
    return (
        f"processor\t: 0\nvendor_id\t: {fields['vendor']}\ncpu family\t: {fields['family']}\n"
        f"model\t\t: {fields['model']}\nmodel name\t: {fields['model_name']}\n"
        f"stepping\t: {fields['stepping']}\nflags\t\t: {' '.join(fields['isa_flags'])}\n"
    )


def first_block(text: str) -> str:
    return text.split("\n\n", 1)[0].rstrip("\n") + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--id", required=True)
    parser.add_argument("--how", required=True, help="how this identity was captured")
    parser.add_argument("--emulated", action="store_true", help="under qemu-user")
    args = parser.parse_args()
    import torch

    fields = machine.cpuid_fields()
    text = machine.proc_cpuinfo()
    if args.emulated:
        assert fields is not None, "cpuid is needed to know an emulated CPU"
        text = cpuinfo_block(fields)
    identity = {
        "id": args.id,
        "how": args.how,
        "machine": platform.machine(),
        "proc_cpuinfo": first_block(text),
        "cpuid": fields,
        "capture": machine.capture_cpu(),
        "torch": torch.__version__,
        "pins": {},
    }
    print(json.dumps(identity, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

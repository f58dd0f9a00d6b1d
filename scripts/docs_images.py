"""The docs' images, drawn by the current plot code from records kept in the repository.

    python scripts/docs_images.py            # redraw docs/img/*.png (make docs-images)
    python scripts/docs_images.py --check    # exit 1 naming each image that is stale

Each image comes from the record files of a real run or sweep under ``docs/img/src/`` (a
smoke run; a smoke sweep over two learning rates and two seeds), drawn by the commands a
user runs, ``reprotrain report`` and ``reprotrain summary``, in a scratch copy. So a change
to the plots shows in the docs after ``make docs-images``, and ``--check`` (run by the test
suite) fails while a committed image is not what the code draws now. Images are compared by
their decoded pixels, not their bytes (PNG metadata names the library version).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"
#: image -> (the command that draws it, its record files under docs/img/src/, the file it writes)
IMAGES = {
    "smoke-run-curves.png": ("report", "smoke-run", "curves.png"),
    "smoke-lr-sweep.png": ("summary", "smoke-lr-sweep", "summary.png"),
}


def draw(image: str, scratch: Path) -> Path:
    """Draw ``image`` from its records in a copy under ``scratch``; the PNG's path."""
    command, source, written = IMAGES[image]
    work = scratch / source
    shutil.copytree(IMG / "src" / source, work)
    # Relative to the scratch dir, so what a plot shows of its path is the same every time.
    args = [source, "--out", source] if command == "report" else [source]
    proc = subprocess.run(
        [sys.executable, "-m", "reprotrain.commands", command, *args],
        cwd=scratch, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"error: reprotrain {command} failed for {image}: {proc.stderr[-500:]}")
    return work / written


def same_pixels(a: Path, b: Path) -> bool:
    import matplotlib.image
    import numpy as np

    if not a.is_file() or not b.is_file():
        return False
    x, y = matplotlib.image.imread(a), matplotlib.image.imread(b)
    return x.shape == y.shape and bool(np.array_equal(x, y))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = []
    with tempfile.TemporaryDirectory(prefix="reprotrain-docs-images-") as tmp:
        for image in IMAGES:
            drawn = draw(image, Path(tmp))
            if same_pixels(drawn, IMG / image):
                continue
            stale.append(image)
            if not args.check:
                shutil.copyfile(drawn, IMG / image)
                print(f"drew docs/img/{image}")
    if args.check and stale:
        names = ", ".join(f"docs/img/{s}" for s in stale)
        print(f"error: {names} differ from what the plot code draws now; run make docs-images")
        return 1
    if not stale:
        print("ok: every docs image is what the plot code draws")
    return 0


if __name__ == "__main__":
    sys.exit(main())

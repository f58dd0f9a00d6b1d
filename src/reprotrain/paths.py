"""Where the repository's pieces are, found from this file (works inside an archived
source snapshot too, which keeps the same src/ + conf/ layout)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"

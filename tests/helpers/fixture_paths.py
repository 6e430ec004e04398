"""Where the community tools' reference checkpoints live: ../shared/fixtures beside the checkout
(kept outside this repository), else /work/shared/fixtures (a clone elsewhere on the same machine)."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
if not FIXTURES.is_dir():
    FIXTURES = Path("/work/shared/fixtures")
MISSING = (
    "../shared/fixtures (the community tools' reference checkpoints, kept outside this repository) "
    "not present"
)

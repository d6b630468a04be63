"""Shared test fixtures: where the real data lives (../shared/data beside the repo, as in CI)."""
import os
from pathlib import Path

import pytest

SHARED_DATA = Path(os.environ.get("LRA_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.fixture
def shared_data():
    """Path to ../shared/data; skips the test, saying why, when the folder is not there."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} not found (set LRA_SHARED_DATA to point at shared/data)")
    return SHARED_DATA

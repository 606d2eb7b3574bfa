import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "mnist").is_dir():
        pytest.skip(f"real datasets not found at {SHARED_DATA} (put ../shared/data beside the repository)")
    return SHARED_DATA

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def docs_home(tmp_path_factory) -> Path:
    """Where the blocks build their tiny checkpoints: HYBRIDCACHE_TEST_HOME (reused between runs) or one temp dir."""
    return Path(os.environ.get("HYBRIDCACHE_TEST_HOME") or tmp_path_factory.mktemp("docs_home"))

"""Where adaptivespec keeps what it makes once per machine (converted models, cost tables, calibration,
built kernels): ``$ADAPTIVESPEC_CACHE``, else ``$XDG_CACHE_HOME/adaptivespec``, else ``~/.cache/adaptivespec``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("ADAPTIVESPEC_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "adaptivespec"
    return Path(root)

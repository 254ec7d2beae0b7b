"""``python scripts/memory_check.py`` runs :mod:`adaptivespec.analysis.memory_check` from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adaptivespec.analysis.memory_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

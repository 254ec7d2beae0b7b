"""``python scripts/serve_check.py`` runs :mod:`adaptivespec.analysis.serve_check` from a checkout (a device machine's copy of the tree)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adaptivespec.analysis.serve_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

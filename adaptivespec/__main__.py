"""``python -m adaptivespec``: the ``adaptivespec`` command."""

from adaptivespec.cli import main

raise SystemExit(main())

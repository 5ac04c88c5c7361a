"""``python -m underlay``."""

from underlay.cli import main

raise SystemExit(main())

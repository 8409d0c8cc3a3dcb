"""`python -m rill` runs the command line."""

from rill.cli import main

raise SystemExit(main())

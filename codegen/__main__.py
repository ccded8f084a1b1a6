"""`python -m codegen`: the moegen command line."""

from codegen.cli import main

raise SystemExit(main())

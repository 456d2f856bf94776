"""`python -m minions_local.planning --plan NAME`: see `minions_local.planning.cli`."""

from minions_local.planning.cli import main

raise SystemExit(main())

"""`python -m minions_local.profile --plan NAME`: see `minions_local.profile.cli`."""

from minions_local.profile.cli import main

raise SystemExit(main())

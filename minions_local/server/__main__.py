import sys

from minions_local.server.cli import main

sys.exit(main())

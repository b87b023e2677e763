import sys

from swarm_bootstrap.cli import main

sys.exit(main())

import sys

from swarm_node.cli.main import main

sys.exit(main())

import sys

from swarm_node.cli import main

sys.exit(main())

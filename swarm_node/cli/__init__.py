"""The ``swarm-node`` command line (``swarm_node.cli.main:main``): ``main.py`` builds the
parser and runs the command named; each command's flags and handler are in the file of
its name (sim, join, local, data, export with generate, probe), the argument types and
help texts they share in ``args.py``. Parsing only: the work is in the packages."""

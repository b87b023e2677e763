"""The ``swarm-node`` command line (``swarm_node.cli.main:main``): ``main.py`` builds the
parser and runs the command named; each command's flags and handler are in the file of
its name (sim, join, local, data, export with generate, probe). A flag several commands
have is declared once, in ``options.py`` (``peer_options.py`` for those swarm-bootstrap
has too), the run-spec keys the training flags set in ``spec_flags.py``, the argument
types in ``args.py``. Parsing only: the work is in the packages."""

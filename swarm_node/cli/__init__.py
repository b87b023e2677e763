"""The ``swarm-node`` command line (``swarm_node.cli.main:main``): ``main.py`` parses every
command and starts what it names (join, local, sim, memory advice); ``export.py`` and
``probe.py`` hold the export, generate and probe commands' parsers. Parsing only: the
work is in the packages."""

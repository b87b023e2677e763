"""One swarm node: ``conductor.py`` starts the components in order, wires them and takes
them down again (``Node``; its start-up half is ``startup.py``); ``config.py`` holds its peer-local settings (``NodeConfig``),
``services.py`` what every component shares (``NodeServices``), and ``report.py`` what
the node tells others: its registry record, its status and its summary.

Nothing is imported here: the components import ``node.services`` and ``node.config``,
and the conductor imports the components."""

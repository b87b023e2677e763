"""One swarm node: ``conductor.py`` starts the components in order, wires them and takes
them down again (``Node``; its start-up half is ``startup.py``); ``report.py`` is what the
node tells others (its registry record, its status and its summary), ``progress_feed.py``
what its volunteer sees.

The types the components share live below them (``swarm_node/node_config.py``,
``swarm_node/node_services.py``): nothing under ``node/`` is imported by a component."""

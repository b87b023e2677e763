"""The network layer: the only code that imports hivemind."""

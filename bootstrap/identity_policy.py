"""Where a bootstrap's identity may live. It is the one secret of a bootstrap host:
losing it changes the multiaddr every volunteer was given; leaking it lets someone
impersonate the bootstrap and sign a different run spec."""

from __future__ import annotations

import logging
from pathlib import Path

from swarm_node.errors import ConfigError
from swarm_node.net.identity import ensure_identity, peer_id_of_identity

log = logging.getLogger("swarm_bootstrap")


def prepare_identity(path: Path) -> str:
    """Create the identity on first use (refusing inside a git work tree, where it could
    be committed), check it otherwise; returns the peer id."""
    path = path.expanduser()
    if path.is_dir():
        raise ConfigError(f"--identity {path} is a folder: give the path of the key file in it (created "
                          f"on first run), e.g. {path / 'bootstrap.key'}")
    file_above = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if file_above is not None:
        raise ConfigError(f"--identity {path}: {file_above} is a file, not a folder; give a path whose "
                          "folders are folders (missing ones are created)")
    if not path.exists():
        repo = _git_work_tree(path.parent)
        if repo is not None:
            raise ConfigError(f"refusing to create the identity {path} inside the git work tree {repo}: a "
                              "private key must never be committed. Choose a path outside it")
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    created = ensure_identity(path)
    peer_id = peer_id_of_identity(path)
    if created:
        log.info("created identity %s (peer id %s); back this file up: it is this bootstrap's address", path,
                 peer_id)
    return peer_id


def _git_work_tree(directory: Path) -> Path | None:
    for candidate in [directory.resolve(), *directory.resolve().parents]:
        if (candidate / ".git").exists():
            return candidate
    return None

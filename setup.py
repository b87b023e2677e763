"""Package layout only; everything else is in pyproject.toml. The bootstrap program is
the top-level folder bootstrap/, installed under the import name swarm_bootstrap."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["swarm_node", "swarm_node.*"]), "swarm_bootstrap"],
    package_dir={"swarm_bootstrap": "bootstrap"},
    package_data={"swarm_node.data": ["corpus/*.gz", "corpus/NOTICE"], "swarm_bootstrap": ["dashboard.html"]},
)

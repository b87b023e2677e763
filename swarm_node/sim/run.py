"""Run the simulator with a progress bar and write its outputs."""

from __future__ import annotations

import logging
from pathlib import Path

from swarm_node.obs.progress import TrainingProgress
from swarm_node.sim.config import SimConfig
from swarm_node.sim.report import summary_lines, write_json, write_plot
from swarm_node.sim.simulator import SimResult, Simulator

log = logging.getLogger("swarm_node.sim")


def run_simulation(config: SimConfig, *, json_out: Path | None = None, plot: Path | None = None,
                   progress: bool = True) -> SimResult:
    sim = Simulator(config)
    log.info("sim: %s, %d replicas x %d stages, %s model (%.2fM parameters), %s, %d steps of %d tokens",
             config.method.name, config.replicas, config.stages, config.model_size,
             sim.model_config.num_parameters() / 1e6, config.data.describe(), config.steps,
             config.tokens_per_step)
    bar = TrainingProgress(config.steps, f"sim {config.method.name}", enabled=progress)
    try:
        result = sim.run(lambda r: bar.update(r.step, r.tokens, r.train_loss, r.val_loss, r.elapsed_s))
    finally:
        bar.close()
    for line in summary_lines(result):
        log.info(line)
    if json_out is not None:
        write_json(result, json_out)
        log.info("wrote %s", json_out)
    if plot is not None:
        write_plot(result, plot)
        log.info("wrote %s", plot)
    return result

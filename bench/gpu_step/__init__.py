"""GPU step efficiency: a stage's step on one card, eager and unfused against fused AdamW,
the chunked loss and torch.compile, per model size and stage split: tokens/s, MFU, peak
memory beside the estimate, compile time. ``benchmark`` measures, ``report`` draws the
plot and the BENCHMARKS.md section; ``device_check.sh`` is the one script a GPU machine
runs (this benchmark, the GPU test tier, the local 2 x 2 swarm on the card).

Run it with ``python -m bench.gpu_step [--full]`` on a CUDA machine, or
``python -m bench.gpu_step --device cpu --quick`` for the CPU smoke run."""

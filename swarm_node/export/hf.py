"""Writing an assembled model as a Hugging Face checkpoint: config.json, model.safetensors
(our parameter names are already Hugging Face's), and the tokenizer files when the run
used a Hugging Face tokenizer. A plain model loads with only `transformers`:
``LlamaForCausalLM.from_pretrained(out_dir)``. A ``bottleneck`` run's model has
boundary layers no Llama holds: its folder also gets the modelling file
modeling_swarm_bottleneck.py (a Llama of transformers' with the boundaries inserted),
which config.json names in ``auto_map``: ``AutoModelForCausalLM.from_pretrained(out_dir,
trust_remote_code=True)``. ``load_exported`` reads either back into our own model
without transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from swarm_node import __version__
from swarm_node.errors import ConfigError
from swarm_node.export.assemble import AssembledModel
from swarm_node.model.boundary import BoundaryConfig
from swarm_node.model.config import ModelConfig
from swarm_node.state.checkpoint import write_tensor_file

MODELLING_FILE = Path(__file__).with_name("modeling_swarm_bottleneck.py")
BOTTLENECK_ARCHITECTURE = "SwarmBottleneckLlamaForCausalLM"
BOTTLENECK_MODEL_TYPE = "swarm_bottleneck_llama"


def hf_config(assembled: AssembledModel) -> dict:
    c = assembled.config
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_seq_len, "rope_theta": c.rope_theta, "rope_scaling": None,
        "rms_norm_eps": c.rms_norm_eps, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "initializer_range": c.init_std,
        "torch_dtype": "float32", "use_cache": True,
        "swarm_node": {"version": __version__, "run_id": assembled.spec.run_id,
                       "spec_hash": assembled.spec.spec_hash(), "peers_per_stage": assembled.peers_per_stage},
    }
    if c.boundary is not None:
        if c.boundary.kind != "bottleneck":  # assemble() multiplies a subspace model out
            raise ValueError(f"a {c.boundary.kind} boundary has no Hugging Face form of its own")
        module = MODELLING_FILE.stem
        config.update(architectures=[BOTTLENECK_ARCHITECTURE], model_type=BOTTLENECK_MODEL_TYPE,
                      auto_map={"AutoConfig": f"{module}.SwarmBottleneckLlamaConfig",
                                "AutoModelForCausalLM": f"{module}.{BOTTLENECK_ARCHITECTURE}"},
                      swarm_boundary={"kind": c.boundary.kind, "width": c.boundary.width,
                                      "cuts": list(c.boundary.cuts)})
    return config


def write_hf_checkpoint(assembled: AssembledModel, out_dir: Path,
                        tokenizer_json: Path | None = None) -> list[Path]:
    """Writes the files; returns their paths. ``tokenizer_json``: the run's tokenizer file
    (None for the built-in byte-level tokenizer, which Hugging Face has no file for)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "config.json", out_dir / "model.safetensors", out_dir / "generation_config.json"]
    written[0].write_text(json.dumps(hf_config(assembled), indent=2) + "\n")
    write_tensor_file(written[1], {k: v.contiguous() for k, v in assembled.state_dict.items()},
                      metadata={"format": "pt"})
    sampling = {"do_sample": True, "temperature": 0.8, "max_new_tokens": 200}
    written[2].write_text(json.dumps(sampling, indent=2) + "\n")
    if assembled.config.boundary is not None:
        written.append(out_dir / MODELLING_FILE.name)
        written[-1].write_text(MODELLING_FILE.read_text())
    if tokenizer_json is not None:
        if not Path(tokenizer_json).is_file():
            raise ConfigError(f"tokenizer file not found: {tokenizer_json}")
        shutil.copyfile(tokenizer_json, out_dir / "tokenizer.json")
        (out_dir / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": assembled.config.max_seq_len},
            indent=2) + "\n")
        written += [out_dir / "tokenizer.json", out_dir / "tokenizer_config.json"]
    return written


def exported_config(config: dict) -> ModelConfig:
    """Our model config from an exported config.json's settings."""
    boundary = config.get("swarm_boundary")
    return ModelConfig(
        hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
        intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
        max_seq_len=config["max_position_embeddings"], rope_theta=config["rope_theta"],
        rms_norm_eps=config["rms_norm_eps"], init_std=config["initializer_range"],
        boundary=None if boundary is None else BoundaryConfig(boundary["kind"], boundary["width"],
                                                              tuple(boundary["cuts"])))


def load_exported(out_dir: Path):
    """An exported folder read back into our own unsplit model (pure torch): what a
    folder's config and weights compute, checked against the swarm without transformers."""
    from safetensors.torch import load_file

    from swarm_node.model.stages import build_model

    out_dir = Path(out_dir)
    model = build_model(exported_config(json.loads((out_dir / "config.json").read_text())), seed=0)
    model.load_state_dict(load_file(out_dir / "model.safetensors"), strict=True)
    return model.eval()

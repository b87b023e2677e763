"""Writing an assembled model as a Hugging Face Llama checkpoint: config.json,
model.safetensors (our parameter names are already Hugging Face's), and the tokenizer
files when the run used a Hugging Face tokenizer. Loading it needs only `transformers`:
``LlamaForCausalLM.from_pretrained(out_dir)``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from swarm_node import __version__
from swarm_node.errors import ConfigError
from swarm_node.export.assemble import AssembledModel
from swarm_node.state.checkpoint import write_tensor_file


def hf_config(assembled: AssembledModel) -> dict:
    c = assembled.config
    return {
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
    written[2].write_text(json.dumps({"do_sample": True, "temperature": 0.8, "max_new_tokens": 200},
                                     indent=2) + "\n")
    if tokenizer_json is not None:
        if not Path(tokenizer_json).is_file():
            raise ConfigError(f"tokenizer file not found: {tokenizer_json}")
        shutil.copyfile(tokenizer_json, out_dir / "tokenizer.json")
        (out_dir / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": assembled.config.max_seq_len},
            indent=2) + "\n")
        written += [out_dir / "tokenizer.json", out_dir / "tokenizer_config.json"]
    return written

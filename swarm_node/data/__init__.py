"""Tokens for training: tokenizers, sources (synthetic Markov, text, token .bin, the
bundled corpus), windows with a held-out validation split, and deterministic shards."""

from swarm_node.data.dataset import TokenWindows, load_windows
from swarm_node.data.markov import MarkovChain, MarkovSpec
from swarm_node.data.sharded_batches import ShardedBatches
from swarm_node.data.spec import DataSpec
from swarm_node.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "DataSpec", "HFTokenizer", "MarkovChain", "MarkovSpec", "ShardedBatches",
           "TokenWindows", "load_tokenizer", "load_windows"]

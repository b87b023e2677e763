import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm_node.data import ByteTokenizer, DataSpec, MarkovChain, MarkovSpec, ShardedBatches, load_windows


@pytest.fixture(scope="module")
def synthetic():
    return load_windows(DataSpec(kind="synthetic", num_tokens=200_000), seq_len=32)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < tok.vocab_size


@given(st.text(max_size=200))
@settings(max_examples=200, deadline=None)
def test_byte_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


@given(st.sampled_from(["synthetic", "corpus", "text:/x", "bin:/y.bin",
                        "synthetic:alphabet=8,order=1", "synthetic:seed=3,tokens=1000"]))
def test_data_spec_parses_known_forms(text):
    spec = DataSpec.parse(text)
    assert spec.kind == text.split(":")[0]


@pytest.mark.parametrize("bad", ["nonsense-path-that-does-not-exist", "synthetic:foo=1", "synthetic:order",
                                 "text:"])
def test_data_spec_rejects_bad_forms(bad):
    with pytest.raises(ValueError):
        DataSpec.parse(bad)


def test_markov_entropy_rate_matches_empirical_estimate():
    chain = MarkovChain(MarkovSpec(alphabet=4, order=1, seed=1))
    windows = chain.sample_windows(20_000, 40, seed=0)
    # Empirical conditional entropy from counts over the sampled transitions.
    counts = np.zeros((4, 4))
    np.add.at(counts, (windows[:, :-1].ravel(), windows[:, 1:].ravel()), 1)
    p = counts / counts.sum(axis=1, keepdims=True)
    weights = counts.sum(axis=1) / counts.sum()
    empirical = float(-(weights * (p * np.log(p)).sum(axis=1)).sum())
    assert empirical == pytest.approx(chain.entropy_rate(), abs=0.01)
    # Windows start stationary: the first symbol's histogram matches the stationary law.
    first = np.bincount(windows[:, 0], minlength=4) / len(windows)
    assert np.allclose(first, chain.stationary, atol=0.02)


def test_loss_floor_accounts_for_the_cold_start():
    chain = MarkovChain(MarkovSpec(alphabet=16, order=2, seed=0))
    rate = chain.entropy_rate()
    assert chain.loss_floor(1000) == pytest.approx(rate, rel=1e-3)
    assert chain.loss_floor(4) > rate  # the first target has only one symbol of context
    assert rate < np.log(16)


def test_windows_targets_are_inputs_shifted(synthetic):
    inputs, targets = synthetic.batch([0, 5])
    assert inputs.shape == targets.shape == (2, 32)
    assert np.array_equal(inputs[:, 1:].numpy(), targets[:, :-1].numpy())
    assert synthetic.entropy_floor is not None and synthetic.vocab_size == 16


def test_shards_are_deterministic_and_disjoint(synthetic):
    def windows_of(shard_id, seed=0, epoch=0):
        return set(ShardedBatches(synthetic, batch_size=4, seed=seed, shard_id=shard_id,
                                  num_shards=3).shard_windows(epoch).tolist())

    shards = [windows_of(k) for k in range(3)]
    assert all(not (shards[a] & shards[b]) for a in range(3) for b in range(a + 1, 3))
    assert shards[0] == windows_of(0)
    assert shards[0] != windows_of(0, seed=1)
    assert max(max(s) for s in shards) < synthetic.num_train_windows  # validation is held out
    assert windows_of(0, epoch=1) != shards[0]


def test_shard_position_resumes_exactly(synthetic):
    a = ShardedBatches(synthetic, batch_size=8, seed=0, shard_id=1, num_shards=2)
    for _ in range(5):
        a.next_batch()
    b = ShardedBatches(synthetic, batch_size=8, seed=0, shard_id=1, num_shards=2)
    b.load_state_dict(a.state_dict())
    for _ in range(3):
        xa, xb = a.next_batch(), b.next_batch()
        assert np.array_equal(xa[0].numpy(), xb[0].numpy())


def test_epochs_roll_over(synthetic):
    loader = ShardedBatches(synthetic, batch_size=64, seed=0, shard_id=0, num_shards=1)
    for _ in range(synthetic.num_train_windows // 64 + 2):
        loader.next_batch()
    assert loader.position.epoch == 1


def test_bundled_corpus_loads():
    data = load_windows(DataSpec(kind="corpus"), seq_len=128)
    assert data.vocab_size == 256 and data.num_train_windows > 10_000
    inputs, _ = data.batch([0])
    assert len(data.tokenizer.decode(inputs[0].tolist())) > 0


def test_text_folder_source(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 300)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("beta " * 300)
    (tmp_path / "ignored.bin").write_bytes(b"\0" * 10)
    data = load_windows(DataSpec.parse(str(tmp_path)), seq_len=16)
    text = data.tokenizer.decode(data.tokens.tolist())
    assert "alpha" in text and "beta" in text


def test_bin_source_with_and_without_metadata(tmp_path):
    tokens = np.arange(10_000, dtype=np.uint16) % 500
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    scanned = load_windows(DataSpec.parse(str(path)), seq_len=15)
    assert scanned.vocab_size == 500
    (tmp_path / "train.bin.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 1024}))
    declared = load_windows(DataSpec.parse(f"bin:{path}"), seq_len=15)
    assert declared.vocab_size == 1024
    assert np.array_equal(declared.batch([1])[0].numpy()[0], tokens[16:31])


def test_too_little_data_is_a_clear_error(tmp_path):
    (tmp_path / "tiny.txt").write_text("x" * 10)
    with pytest.raises(ValueError, match="too few"):
        load_windows(DataSpec.parse(str(tmp_path / "tiny.txt")), seq_len=64)


def test_hugging_face_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["the", "swarm", "trains", "a", "model", "[UNK]"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "text.txt").write_text("the swarm trains a model " * 200 + "zebra")

    spec = DataSpec(kind="text", path=str(tmp_path / "text.txt"),
                    tokenizer_path=str(tmp_path / "tokenizer.json"))
    data = load_windows(spec, seq_len=8)
    assert data.vocab_size == len(words)
    assert data.tokens[:5].tolist() == [0, 1, 2, 3, 4]
    assert data.tokens[-1] == words.index("[UNK]")
    assert data.tokenizer.decode([1, 2]) == "swarm trains"


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    from swarm_node.data import HFTokenizer

    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        HFTokenizer(tmp_path / "nope.json")


@pytest.mark.parametrize("alphabet, order", [(16, 1), (16, 2), (8, 3), (64, 1)])
def test_sampled_windows_are_the_row_comparison_draws_exactly(alphabet, order):
    """The sampler counts cdf values below u a column at a time, for speed; it must draw
    exactly what comparing whole rows does, so a seed names the same data everywhere."""
    chain = MarkovChain(MarkovSpec(alphabet, order, 0.5, 3))
    n, length, seed = 500, 30, 7
    rng = np.random.default_rng([3, seed, 0x77696E64])
    expected = np.empty((n, length), dtype=np.uint8)
    contexts = rng.choice(chain.num_contexts, size=n, p=chain.stationary)
    digits = contexts.copy()
    for pos in range(order - 1, -1, -1):
        expected[:, pos] = digits % alphabet
        digits //= alphabet
    cdf = np.cumsum(chain.transitions, axis=1)
    cdf[:, -1] = 1.0
    for pos in range(order, length):
        symbols = (rng.random(n)[:, None] > cdf[contexts]).sum(axis=1)
        expected[:, pos] = symbols
        contexts = (contexts * alphabet + symbols) % chain.num_contexts
    assert np.array_equal(chain.sample_windows(n, length, seed=seed), expected)

"""Local Hugging Face datasets as data (`--data hf:PATH`): a save_to_disk folder, json
lines and parquet files give the same tokens as the same text. Slow tier: it needs the
`hf-datasets` extra, which `./dev.sh test-slow` installs."""

import json

import pytest

from swarm_node.data.dataset import load_windows
from swarm_node.data.spec import DataSpec

DOCS = [f"Document {i}: the quick brown fox jumps over the lazy dog. " * 20 for i in range(40)]


@pytest.mark.slow
def test_saved_dataset_json_lines_and_parquet_give_the_same_windows(tmp_path):
    import datasets

    table = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "with-splits"))
    (tmp_path / "lines").mkdir()
    (tmp_path / "lines" / "part-0.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in DOCS[:20])
    )
    (tmp_path / "lines" / "part-1.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in DOCS[20:])
    )
    table.to_parquet(str(tmp_path / "docs.parquet"))
    (tmp_path / "plain.txt").write_text("\n\n".join(DOCS))

    expected = load_windows(DataSpec(kind="text", path=str(tmp_path / "plain.txt")), 64)
    for source in ("saved", "with-splits", "lines", "docs.parquet"):
        got = load_windows(DataSpec.parse(f"hf:{tmp_path / source}"), 64)
        assert got.vocab_size == 256 and (got.tokens == expected.tokens).all(), source


@pytest.mark.slow
def test_a_missing_text_column_names_the_columns_there_are(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match="no column 'text' \\(columns: body\\); set data.text_field"):
        load_windows(DataSpec(kind="hf", path=str(tmp_path / "saved")), 64)
    windows = load_windows(DataSpec(kind="hf", path=str(tmp_path / "saved"), text_field="body"), 64)
    assert windows.num_train_windows > 0

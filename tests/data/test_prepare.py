"""`harness data prepare|verify`: formats, tokenizers, exact restarts after SIGKILL, clear errors."""

from __future__ import annotations

import gzip
import json
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard

from harness.cli import main
from harness.data.prepare import STATE_NAME, PrepareSpec, prepare
from harness.data.shard_index import read_index
from procs import ENV, popen

DOCS = ["first document\nwith two lines", "zweites Dokument: äöü €", "third", "x" * 50]


def _inputs(tmp_path: Path) -> list[str]:
    """The four documents spread over every input kind: text, JSON lines, .gz and .zst."""
    (tmp_path / "a.txt").write_text(DOCS[0])
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": DOCS[1], "id": 1}) + "\n\n")
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(DOCS[2].encode()))
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        (json.dumps({"text": DOCS[3]}) + "\n").encode()))
    return [str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.txt.gz", "d.jsonl.zst")]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_bytes_tokenizer_shards_hold_every_document_then_eod(tmp_path):
    out = tmp_path / "ds"
    index = prepare(PrepareSpec(tuple(_inputs(tmp_path)), "bytes", shard_tokens=16), str(out))
    tokens = np.concatenate([np.fromfile(out / s.name, dtype="<u2") for s in index.shards])
    assert len(tokens) == sum(len(d.encode()) + 1 for d in DOCS) == index.total_tokens
    eod = np.flatnonzero(tokens == 256)
    assert list(eod) == list(np.cumsum([len(d.encode()) + 1 for d in DOCS]) - 1)
    assert bytes(tokens[tokens != 256].astype(np.uint8)) == "".join(DOCS).encode()
    assert index.dtype == "uint16" and index.vocab_size == 257 and index.tokenizer["eod_id"] == 256
    assert [s.tokens for s in index.shards][:-1] == [16] * (len(index.shards) - 1)
    assert index.total_documents == len(DOCS)
    assert sum(s.documents for s in index.shards) == len(DOCS)
    assert (out / "index.json").read_bytes() == read_index(str(out))[0].to_json()
    assert not (out / STATE_NAME).exists()


def test_train_bpe_is_deterministic_and_independent_of_worker_count(tmp_path):
    spec = PrepareSpec(("builtin:corpus",), "train-bpe:400", shard_tokens=20000)
    one = prepare(spec, str(tmp_path / "w0"), workers=0)
    two = prepare(spec, str(tmp_path / "w2"), workers=2)
    assert one.vocab_size <= 400 and one.dtype == "uint16"
    assert _files(tmp_path / "w0") == _files(tmp_path / "w2")
    assert one.sha256 == two.sha256


def _run_prepare(args: list[str]) -> subprocess.Popen:
    return popen(["data", "prepare", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)


def _shards_recorded(out: Path) -> int:
    try:
        return len(json.loads((out / STATE_NAME).read_text())["shards"])
    except (FileNotFoundError, json.JSONDecodeError):
        return -1 if (out / "index.json").exists() else 0


def _kill_prepare_after(args: list[str], out: Path, shards: int) -> None:
    """Start `data prepare ARGS --out OUT` and SIGKILL it once its resume state records `shards` shards."""
    proc = _run_prepare([*args, "--out", str(out)])
    while proc.poll() is None and 0 <= _shards_recorded(out) < shards:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL and _shards_recorded(out) >= shards, "the prepare ended before the kill"


def test_prepare_killed_at_random_points_continues_to_byte_identical_output(tmp_path):
    """Real SIGKILLs at seeded random points (after a random number of recorded shards plus a
    random delay); each restart continues, and the final folder equals an uninterrupted run."""
    args = ["builtin:corpus", "--tokenizer", "bytes", "--shard-tokens", "3000", "--workers", "0"]
    reference = tmp_path / "reference"
    prepare(PrepareSpec(("builtin:corpus",), "bytes", shard_tokens=3000), str(reference))
    total = len(read_index(str(reference))[0].shards)
    out = tmp_path / "killed"
    rng = random.Random(19)
    kills = 0
    for target in sorted(rng.sample(range(0, total - 2), 4)):
        proc = _run_prepare([*args, "--out", str(out)])
        while proc.poll() is None and 0 <= _shards_recorded(out) < target:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.05))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.communicate()
        if (out / "index.json").exists() and not (out / STATE_NAME).exists():
            break
    assert kills >= 2, "the prepare finished before it could be killed twice"
    if not (out / "index.json").exists() or (out / STATE_NAME).exists():
        proc = _run_prepare([*args, "--out", str(out)])
        _, err = proc.communicate()
        assert proc.returncode == 0, err.decode()[-2000:]
    assert _files(out) == _files(reference)


def test_a_killed_prepare_whose_input_changed_starts_again_from_the_beginning(tmp_path):
    """SIGKILL mid-prepare, then the input's first line edited and a line appended: the same
    command warns, names the input, and gives exactly what a fresh prepare of the new input
    gives (no shard of the old text, no stale file)."""
    from harness.data.corpus import default_corpus

    text = tmp_path / "corpus.txt"
    text.write_bytes(default_corpus())
    args = [str(text), "--tokenizer", "bytes", "--text-split", "line", "--shard-tokens", "1000", "--workers", "0"]
    out = tmp_path / "killed"
    _kill_prepare_after(args, out, 3)
    first, rest = text.read_text().split("\n", 1)
    text.write_text(f"{first.upper()}\n{rest}one more paragraph at the end\n")
    proc = _run_prepare([*args, "--out", str(out)])
    _, err = proc.communicate()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert "an input changed since this prepare started" in err.decode() and str(text) in err.decode()
    reference = tmp_path / "reference"
    prepare(PrepareSpec((str(text),), "bytes", text_split="line", shard_tokens=1000), str(reference))
    assert _files(out) == _files(reference)


def test_inputs_without_text_are_refused_and_leave_nothing(tmp_path, capsys):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": ""}) + "\n\n")
    inputs = [str(tmp_path / "empty.txt"), str(tmp_path / "blank.jsonl")]
    for tokenizer, message in [("bytes", "the inputs hold no text"), ("train-bpe:512", "hold no text to train it on")]:
        out = tmp_path / tokenizer.replace(":", "-")
        code, err = _cli(capsys, "data", "prepare", *inputs, "--out", str(out), "--tokenizer", tokenizer,
                         "--workers", "0")
        assert code == 2 and message in err and len(err.splitlines()) == 1, err
        assert list(out.iterdir()) == []


def test_a_trained_vocabulary_smaller_than_asked_is_a_warning_naming_both(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("a little text, too little for a large vocabulary\n")
    out = tmp_path / "ds"
    code, err = _cli(capsys, "data", "prepare", str(tmp_path / "a.txt"), "--out", str(out), "--tokenizer",
                     "train-bpe:100000", "--workers", "0")
    vocabulary = read_index(str(out))[0].vocab_size
    assert code == 0 and vocabulary < 100000
    assert "vocabulary is smaller than asked" in err and f"asked=100000 got={vocabulary}" in err, err


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err.strip()


def test_verify_names_a_corrupt_or_missing_shard_in_one_line(tmp_path, capsys):
    out = tmp_path / "ds"
    prepare(PrepareSpec(tuple(_inputs(tmp_path)), "bytes", shard_tokens=16), str(out))
    assert _cli(capsys, "data", "verify", str(out))[0] == 0
    shard = out / "shard-000001.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 1
    shard.write_bytes(bytes(data))
    code, err = _cli(capsys, "data", "verify", str(out))
    assert code == 2 and "shard-000001.bin is corrupt" in err and len(err.splitlines()) == 1
    shard.unlink()
    code, err = _cli(capsys, "data", "verify", str(out))
    assert code == 2 and "shard-000001.bin is missing" in err and len(err.splitlines()) == 1
    code, err = _cli(capsys, "data", "verify", str(tmp_path / "nothing"))
    assert code == 2 and "index.json does not exist" in err


def test_verify_of_a_file_or_a_bad_index_says_what_is_wrong_in_one_line(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello")
    code, err = _cli(capsys, "data", "verify", str(tmp_path / "a.txt"))
    assert code == 2 and "a.txt is a file, not a dataset folder" in err and len(err.splitlines()) == 1, err
    out = tmp_path / "ds"
    prepare(PrepareSpec((str(tmp_path / "a.txt"),), "bytes"), str(out))
    capsys.readouterr()
    good = json.loads((out / "index.json").read_text())
    for damage, message in [(lambda d: d.pop("dtype"), "the index has no 'dtype' entry"),
                            (lambda d: d["shards"][0].pop("sha256"), "shards[0] has no 'sha256' entry"),
                            (lambda d: d["tokenizer"].pop("eod_id"), "the index's tokenizer has no 'eod_id' entry"),
                            (lambda d: d.update(dtype="int8"), "its dtype 'int8' is not one of")]:
        doc = json.loads(json.dumps(good))
        damage(doc)
        (out / "index.json").write_text(json.dumps(doc))
        code, err = _cli(capsys, "data", "verify", str(out))
        assert code == 2 and f"is not a token-shard index: {message}" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("name, content, message", [
    ("blob.bin", bytes(range(256)) * 4, "is not UTF-8 text (line 2, byte offset 128: invalid start byte)"),
    # The reader decodes ahead of the lines it hands out: the position must be the byte's own.
    ("late.txt.gz", gzip.compress(b"ok\n" * 5000 + "äö\n".encode() + b"x\xc3"),
     "is not UTF-8 text (line 5002, byte offset 15006: unexpected end of data)"),
    ("zeros.txt", b"abc\x00\x00\x00", "holds NUL bytes"),
    ("rows.jsonl", b'{"body": "no text field"}\n', "has no field 'text'; pass --text-field"),
    ("rows2.jsonl", b"not json\n", "is not JSON"),
    ("broken.txt.gz", b"\x1f\x8b\x08\x00garbage", "cannot be decompressed"),
], ids=["binary", "late-bad-utf8", "nul", "no-field", "not-json", "bad-gzip"])
def test_bad_inputs_are_one_line_errors(tmp_path, capsys, name, content, message):
    (tmp_path / name).write_bytes(content)
    code, err = _cli(capsys, "data", "prepare", str(tmp_path / name), "--out", str(tmp_path / "ds"),
                     "--tokenizer", "bytes", "--workers", "0")
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "ds" / "index.json").exists()


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello")
    base = [str(tmp_path / "a.txt"), "--workers", "0"]
    for extra, message in [(["--tokenizer", "train-bpe:10"], "VOCAB must be an integer"),
                           (["--tokenizer", str(tmp_path / "none.json")], "no such file"),
                           (["--tokenizer", str(tmp_path / "a.txt")], "is not a tokenizers JSON file"),
                           (["--tokenizer", "bytes", "--shard-tokens", "0"], "--shard-tokens must be >= 1")]:
        code, err = _cli(capsys, "data", "prepare", *base, "--out", str(tmp_path / "ds"), *extra)
        assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert _cli(capsys, "data", "prepare", *base, "--out", str(tmp_path / "ds"), "--tokenizer", "bytes")[0] == 0
    code, err = _cli(capsys, "data", "prepare", *base, "--out", str(tmp_path / "ds"), "--tokenizer", "bytes")
    assert code == 2 and "already holds a prepared dataset" in err


def _unk_only_tokenizer(path: Path) -> str:
    """A word-level tokenizer whose one special token is its unknown-word token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["[UNK]"])
    tokenizer.save(str(path))
    return str(path)


def test_a_separator_the_tokenizer_emits_for_text_is_refused(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello unknown world\n" * 20)
    tokenizer = _unk_only_tokenizer(tmp_path / "tokenizer.json")
    base = ["data", "prepare", str(tmp_path / "a.txt"), "--tokenizer", tokenizer, "--workers", "0"]
    code, err = _cli(capsys, *base, "--out", str(tmp_path / "ds"))
    assert code == 2 and "has no token '<|endoftext|>'" in err and "it has no other special token" in err, err
    code, err = _cli(capsys, *base, "--out", str(tmp_path / "ds"), "--eod", "[UNK]")
    assert code == 2 and "'[UNK]' is its unknown-word token" in err and len(err.splitlines()) == 1, err
    assert list((tmp_path / "ds").iterdir()) == []


@pytest.mark.parametrize("workers", ["0", "2"])
def test_text_that_encodes_to_the_separator_is_refused_and_the_output_removed(tmp_path, capsys, workers):
    """The separator written out in a document: its id would count a document that is not there."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 9}) + "\n" for i in range(30))
                                      + json.dumps({"text": "quoting <|endoftext|> in text"}) + "\n")
    out = tmp_path / "ds"
    code, err = _cli(capsys, "data", "prepare", str(tmp_path / "a.jsonl"), "--out", str(out), "--tokenizer", "bytes",
                     "--shard-tokens", "100", "--workers", workers)
    assert code == 2 and "encodes text of document 31 " in err and "holds '<|endoftext|>' literally" in err, err
    assert len(err.splitlines()) == 1 and list(out.iterdir()) == []


def test_verify_counts_the_end_of_document_ids_of_every_shard(tmp_path, capsys):
    out = tmp_path / "ds"
    prepare(PrepareSpec(tuple(_inputs(tmp_path)), "bytes", shard_tokens=16), str(out))
    capsys.readouterr()
    doc = json.loads((out / "index.json").read_text())
    shard = next(s for s in doc["shards"] if s["documents"])
    shard["documents"] -= 1  # as an index that counted documents, not the EOD ids the shard holds
    (out / "index.json").write_text(json.dumps(doc))
    code, err = _cli(capsys, "data", "verify", str(out))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert (f"{shard['name']} holds {shard['documents'] + 1} end-of-document ids (256), the index says "
            f"{shard['documents']} documents") in err, err


def test_restart_with_other_arguments_is_refused(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world")
    out = tmp_path / "ds"
    prepare(PrepareSpec((str(tmp_path / "a.txt"),), "bytes", shard_tokens=4), str(out))
    (out / "index.json").unlink()  # as if killed before the index: the state file is gone too
    (out / STATE_NAME).write_text(json.dumps({"spec": {"inputs": ["other"]}, "shards": [], "next": [0, 0]}))
    code, err = _cli(capsys, "data", "prepare", str(tmp_path / "a.txt"), "--out", str(out), "--tokenizer", "bytes",
                     "--shard-tokens", "4", "--workers", "0")
    assert code == 2 and "unfinished prepare with other arguments" in err


def test_resume_inside_a_document_spanning_many_shards(tmp_path, monkeypatch):
    """Crashes every third shard while cutting two long documents: restarts land deep inside a
    document (past its first shard), and the output still equals an uninterrupted prepare."""
    import harness.data.prepare as prepare_module

    (tmp_path / "long.txt").write_text("".join(f"line {i} of one long document\n" for i in range(60)))
    spec = PrepareSpec((str(tmp_path / "long.txt"), str(tmp_path / "long.txt")), "bytes", shard_tokens=97)
    prepare(spec, str(tmp_path / "reference"))
    write_shard = prepare_module._write_shard

    def crashing_at_third_shard():
        """A `_write_shard` that writes, then raises KeyboardInterrupt right after its third shard."""
        calls = []

        def crashing(*args, **kwargs):
            write_shard(*args, **kwargs)
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt("simulated crash")

        return crashing

    offsets = []
    for _ in range(6):
        monkeypatch.setattr(prepare_module, "_write_shard", crashing_at_third_shard())
        with pytest.raises(KeyboardInterrupt):
            prepare(spec, str(tmp_path / "resumed"))
        offsets.append(json.loads((tmp_path / "resumed" / STATE_NAME).read_text())["next"][1])
    assert max(offsets) > 2 * 97, offsets  # resumed inside a document, beyond its second shard
    monkeypatch.setattr(prepare_module, "_write_shard", write_shard)
    prepare(spec, str(tmp_path / "resumed"))
    assert _files(tmp_path / "resumed") == _files(tmp_path / "reference")


# Parquet files and `datasets` folders (harness/data/columnar.py): each row's text is a document,
# exactly as the same text given as JSON lines.

ROWS = [f"row {i}: " + "word " * (i % 7) + "äö€" * (i % 3) if i % 11 else "" for i in range(2500)]


def _jsonl(path: Path, rows: list, field: str = "text") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, field: row}) + "\n" for i, row in enumerate(rows)))
    return str(path)


def _parquet(path: Path, columns: dict, row_group_size: int = 700) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), str(path), row_group_size=row_group_size)
    return str(path)


def _saved_dataset(folder: Path, columns: dict, files: int = 2) -> str:
    """A folder as `datasets.Dataset.save_to_disk` writes it: arrow IPC streams of record batches
    (schema metadata "huggingface" with the features), dataset_info.json, state.json listing them."""
    import pyarrow as pa

    table = pa.table(columns)
    features = {name: {"dtype": "string" if pa.types.is_string(t) else str(t), "_type": "Value"}
                for name, t in zip(table.schema.names, table.schema.types, strict=True)}
    schema = table.schema.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    folder.mkdir(parents=True)
    names, per_file = [], -(-len(table) // files)
    for number in range(files):
        names.append(f"data-{number:05d}-of-{files:05d}.arrow")
        with pa.ipc.new_stream(str(folder / names[-1]), schema) as writer:
            writer.write_table(table.slice(number * per_file, per_file).cast(schema), max_chunksize=300)
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": features,
                                                          "homepage": "", "license": ""}, indent=2))
    (folder / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": name} for name in names], "_fingerprint": "0123456789abcdef",
        "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
        "_split": None}, indent=2))
    return str(folder)


def _prepared(capsys, out: Path, *inputs: str, args: tuple[str, ...] = ("--tokenizer", "bytes")) -> dict[str, bytes]:
    code, err = _cli(capsys, "data", "prepare", *inputs, "--out", str(out), "--shard-tokens", "4096",
                     "--workers", "0", *args)
    assert code == 0, err
    return _files(out)


@pytest.mark.parametrize("tokenizer", ["bytes", "train-bpe:300"])
def test_parquet_of_many_row_groups_prepares_the_bytes_json_lines_give(tmp_path, capsys, tokenizer):
    import pyarrow.parquet as pq

    parquet = _parquet(tmp_path / "rows.parquet", {"id": list(range(len(ROWS))), "text": ROWS})
    assert pq.ParquetFile(parquet).metadata.num_row_groups == 4
    jsonl = _jsonl(tmp_path / "rows.jsonl", ROWS)
    from_parquet = _prepared(capsys, tmp_path / "p", parquet, args=("--tokenizer", tokenizer))
    assert len([name for name in from_parquet if name.startswith("shard-")]) > 5
    assert from_parquet == _prepared(capsys, tmp_path / "j", jsonl, args=("--tokenizer", tokenizer))
    assert read_index(str(tmp_path / "p"))[0].total_documents == sum(1 for row in ROWS if row)


def test_a_save_to_disk_folder_and_its_arrow_files_prepare_the_bytes_json_lines_give(tmp_path, capsys):
    folder = _saved_dataset(tmp_path / "saved", {"text": ROWS, "id": list(range(len(ROWS)))})
    reference = _prepared(capsys, tmp_path / "j", _jsonl(tmp_path / "rows.jsonl", ROWS))
    assert _prepared(capsys, tmp_path / "folder", folder) == reference
    arrow_files = [f"{folder}/data-00000-of-00002.arrow", f"{folder}/data-00001-of-00002.arrow"]
    assert _prepared(capsys, tmp_path / "files", *arrow_files) == reference


def test_text_field_names_the_column_of_parquet_and_arrow_inputs(tmp_path, capsys):
    """`--text-field content` reads that column and no other (the `text` column is a decoy);
    `--field` is the same option."""
    columns = {"text": ["not this"] * len(ROWS), "content": ROWS}
    reference = _prepared(capsys, tmp_path / "j", _jsonl(tmp_path / "rows.jsonl", ROWS, field="content"),
                          args=("--tokenizer", "bytes", "--field", "content"))
    for name, url in [("p", _parquet(tmp_path / "rows.parquet", columns)),
                      ("s", _saved_dataset(tmp_path / "saved", columns))]:
        assert _prepared(capsys, tmp_path / name, url, args=("--tokenizer", "bytes", "--text-field", "content")) \
            == reference


def _damaged_page(tmp_path: Path) -> list[str]:
    """A parquet file whose footer is sound and whose first page header is not: found only
    while reading, after the upfront check passed."""
    path = _parquet(tmp_path / "damaged.parquet", {"text": ROWS})
    data = bytearray(Path(path).read_bytes())
    data[4:40] = b"\xff" * 36
    return [str(_write(Path(path), bytes(data)))]


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def _state_only(tmp_path: Path, files: list) -> list[str]:
    _write(tmp_path / "saved" / "dataset_info.json", "{}")
    return [str(_write(tmp_path / "saved" / "state.json", json.dumps({"_data_files": files})).parent)]


@pytest.mark.parametrize("make, name, message", [
    (lambda p: [_parquet(p / "a.parquet", {"body": ["x"]})], "a.parquet",
     "has no column 'text' (its columns: body); pass --text-field"),
    (lambda p: [_saved_dataset(p / "saved", {"body": ["x"]})], "data-00000-of-00002.arrow",
     "has no column 'text' (its columns: body); pass --text-field"),
    (lambda p: [_parquet(p / "a.parquet", {"text": [1, 2], "title": ["a", "b"]})], "a.parquet",
     "column 'text' holds int64, not strings; pass --text-field with the column holding the text (its string "
     "columns: title)"),
    (lambda p: [_parquet(p / "a.parquet", {"text": ["a", "b", None, "d"]})], "a.parquet",
     "row 3: column 'text' is null, not text"),
    (lambda p: [str(_write(p / "a.parquet", b"PAR1" + bytes(100)))], "a.parquet",
     "is not a readable parquet file (Parquet magic bytes not found in footer."),
    (_damaged_page, "damaged.parquet", "is not a readable parquet file (Couldn't deserialize thrift"),
    (lambda p: [str(_write(p / "a.arrow", "not arrow"))], "a.arrow", "is not a readable Arrow IPC stream file"),
    (lambda p: _state_only(p, []), "saved", "lists no arrow files (_data_files); save the dataset again"),
    (lambda p: _state_only(p, [{"filename": "data-00000-of-00001.arrow"}]), "saved",
     "data-00000-of-00001.arrow, listed in its state.json, is missing"),
    (lambda p: [str(_write(p / "plain" / "notes.txt", "x").parent)], "plain",
     "is a folder without state.json: not a dataset saved with save_to_disk"),
    (lambda p: [str(_write(p / "dd" / "dataset_dict.json", '{"splits": ["train", "test"]}').parent)], "dd",
     "is a DatasetDict (splits: train, test); pass one split's folder, e.g. "),
    # A good input first: the bad column of the second is found before any shard is written.
    (lambda p: [_jsonl(p / "a.jsonl", ROWS), _parquet(p / "b.parquet", {"body": ["x"]})], "b.parquet",
     "has no column 'text'"),
], ids=["parquet-no-column", "folder-no-column", "not-strings", "null", "corrupt-parquet", "damaged-page",
        "corrupt-arrow", "no-arrow-files", "arrow-file-missing", "not-saved", "dataset-dict", "second-input"])
def test_bad_columnar_inputs_are_one_line_errors_and_leave_nothing(tmp_path, capsys, make, name, message):
    inputs = make(tmp_path / "in")
    out = tmp_path / "ds"
    code, err = _cli(capsys, "data", "prepare", *inputs, "--out", str(out), "--tokenizer", "bytes",
                     "--shard-tokens", "64", "--workers", "0")
    assert code == 2 and message in err and name in err and len(err.splitlines()) == 1, err
    assert list(out.iterdir()) == []


def test_prepare_of_parquet_killed_continues_to_byte_identical_output(tmp_path):
    """A real SIGKILL after a few recorded shards; the same command resumes at the recorded row
    (inside a row group) and ends with an uninterrupted prepare's bytes."""
    from harness.data.corpus import default_corpus

    parquet = _parquet(tmp_path / "corpus.parquet", {"text": default_corpus().decode("ascii").splitlines() * 4},
                       row_group_size=100)
    args = [parquet, "--tokenizer", "bytes", "--shard-tokens", "3000", "--workers", "0"]
    reference = tmp_path / "reference"
    prepare(PrepareSpec((parquet,), "bytes", shard_tokens=3000), str(reference))
    out = tmp_path / "killed"
    _kill_prepare_after(args, out, 5)
    proc = _run_prepare([*args, "--out", str(out)])
    _, err = proc.communicate()
    assert proc.returncode == 0 and "resuming prepare" in err.decode(), err.decode()[-2000:]
    assert _files(out) == _files(reference)


def test_a_folder_fixed_after_a_failed_prepare_is_prepared_again_from_the_beginning(tmp_path, capsys):
    """A null row in the second arrow file stops the prepare after shards of the first were
    recorded; the folder saved again with that row filled has another identity (its arrow
    files'), so the same command starts again and gives what a fresh prepare gives."""
    rows = ROWS[:]
    rows[2000] = None
    folder = _saved_dataset(tmp_path / "saved", {"text": rows})
    args = ("data", "prepare", folder, "--tokenizer", "bytes", "--shard-tokens", "4096", "--workers", "0")
    code, err = _cli(capsys, *args, "--out", str(tmp_path / "ds"))
    assert code == 2 and "data-00001-of-00002.arrow row 751: column 'text' is null" in err, err
    assert _shards_recorded(tmp_path / "ds") > 3
    rows[2000] = "filled"
    shutil.rmtree(folder)
    _saved_dataset(tmp_path / "saved", {"text": rows})
    code, err = _cli(capsys, *args, "--out", str(tmp_path / "ds"))
    assert code == 0 and "an input changed since this prepare started" in err and folder in err, err
    assert _files(tmp_path / "ds") == _prepared(capsys, tmp_path / "fresh", folder)

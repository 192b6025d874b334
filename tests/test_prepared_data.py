"""Prepared data: tokenized once (in parallel) into memory-mapped storage, the same rows as the plain
in-memory reference (``load_documents`` + ``pack_documents``), every input format, refusals."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runs import run

from dflash_trainer.data.documents import load_documents
from dflash_trainer.data.packing import pack_documents, plan_rows
from dflash_trainer.data.prepare import DataRequest, ensure_prepared, open_prepared, prepare_data, tokenizer_fingerprint
from dflash_trainer.data.records import iter_records
from dflash_trainer.data.storage import PreparedData, StorageError
from dflash_trainer.errors import UserError
from dflash_trainer.tiny_target import tiny_target_path

SEQ_LEN, MIN_TOKENS = 48, 5
WORDS = "def return for in range print sum len list x y total mean value index".split()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_path(), local_files_only=True)


def conversations(n: int, seed: int = 0) -> list[dict]:
    """Chat records of varied length (some longer than SEQ_LEN: they are split into pieces)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        answer = " ".join(rng.choice(WORDS, size=int(rng.integers(10, 40))))
        out.append({"messages": [{"role": "user", "content": f"task {i}"}, {"role": "assistant", "content": answer}]})
    return out


def mixed_records() -> list:
    """Good chat / ShareGPT / pre-tokenized records and one of each common bad kind, in one file."""
    good = conversations(40)
    bad = [
        '{"messages": [',  # invalid JSON
        {"messages": []},  # empty conversation
        {"conversations": [{"from": "human", "value": "anyone?"}]},  # no assistant turn
        {"input_ids": [5, 6, 7], "loss_mask": [1, 1, 1]},  # too short
        {"input_ids": [5, 6, 10**6, 8, 9, 10], "loss_mask": [1] * 6},  # id out of range
    ]
    records = []
    for i, record in enumerate(good):
        records.append(record)
        if i % 8 == 3:
            records.append(bad[i // 8])
    records.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "def f(): pass"}]})
    records.append({"input_ids": list(range(3, 120)), "loss_mask": [0] * 10 + [1] * 107})  # 117 tokens: 3 pieces
    return records


def write_jsonl(path: Path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def request(tok, train, eval_=(), *, holdout=None, seq_len=SEQ_LEN, columns=(), vocab=None) -> DataRequest:
    holdout = holdout or ("files" if eval_ else "fraction")
    return DataRequest(
        train_paths=tuple(train),
        eval_paths=tuple(eval_),
        holdout=holdout,
        eval_fraction=0.2,
        seq_len=seq_len,
        min_tokens=MIN_TOKENS,
        vocab_size=vocab or len(tok),
        pad_token_id=tok.pad_token_id,
        max_record_bytes=1 << 20,
        columns=tuple(columns),
        tokenizer=tokenizer_fingerprint(tok),
    )


def assert_same_rows(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        for name in ("input_ids", "position_ids", "loss_mask"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype == torch.long and torch.equal(x, y), name


def reference_rows(tok, paths, seq_len=SEQ_LEN, eval_fraction=0.2):
    docs, report = load_documents(paths, tok, vocab_size=len(tok), min_tokens=MIN_TOKENS, max_bad_fraction=1.0)
    n_eval = max(1, int(len(docs) * eval_fraction))
    train = pack_documents(docs[:-n_eval], seq_len, tok.pad_token_id)
    held_out = pack_documents(docs[-n_eval:], seq_len, tok.pad_token_id)
    return train, held_out, report


# ---------------------------------------------------------------- the same rows as the reference


def test_storage_holds_the_reference_rows_bit_for_bit_and_the_same_report(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", mixed_records())
    b = write_jsonl(tmp_path / "b.jsonl", conversations(15, seed=1))
    data = PreparedData(prepare_data(request(tok, [a, b]), tok, tmp_path / "prepared", num_workers=1, progress=False))
    train, held_out, report = reference_rows(tok, [a, b])
    assert any(int((r.position_ids == 0).sum()) > 2 for r in train)  # rows hold several documents
    assert_same_rows(data.rows("train"), train)
    assert_same_rows(data.rows("eval"), held_out)
    assert data.report("train").to_dict() == report.to_dict()  # every bad record, by file and line
    kinds = {"invalid JSON", "empty conversation", "no assistant turn", "too short", "token id out of range"}
    assert kinds <= set(report.counts) and data.manifest["n_tokens"] == report.n_tokens
    assert_same_rows(data.rows("train")[2:5], train[2:5])  # slices and negative indices read like a list
    assert_same_rows([data.rows("train")[-1]], [train[-1]])
    with pytest.raises(IndexError):
        data.rows("train")[len(train)]


def test_plan_rows_packs_like_pack_documents_on_random_lengths(tok):
    from dflash_trainer.data.documents import Document

    rng = np.random.default_rng(3)
    for seq_len in (1, 7, 64):
        lengths = rng.integers(1, 150, size=200)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        flat = rng.integers(0, 1000, size=int(lengths.sum()))
        docs = [
            Document(flat[s : s + n].tolist(), [1] * int(n), "x", i) for i, (s, n) in enumerate(zip(starts, lengths))
        ]
        expected = [r.input_ids.tolist() for r in pack_documents(docs, seq_len, pad_token_id=-1)]
        offsets, pieces = plan_rows(starts, lengths, seq_len)
        got = []
        for r in range(len(offsets) - 1):
            ids = [t for s, n in pieces[offsets[r] : offsets[r + 1]] for t in flat[s : s + n].tolist()]
            got.append(ids + [-1] * (seq_len - len(ids)))
        assert got == expected


def test_held_out_files_and_eval_without_holdout(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", conversations(30))
    e = write_jsonl(tmp_path / "e.jsonl", mixed_records())
    data = PreparedData(prepare_data(request(tok, [a], [e]), tok, tmp_path / "p", num_workers=1, progress=False))
    docs, _ = load_documents([a], tok, vocab_size=len(tok), min_tokens=MIN_TOKENS, max_bad_fraction=0.0)
    eval_docs, eval_report = load_documents([e], tok, vocab_size=len(tok), min_tokens=MIN_TOKENS, max_bad_fraction=1.0)
    assert_same_rows(data.rows("train"), pack_documents(docs, SEQ_LEN, tok.pad_token_id))
    assert_same_rows(data.rows("eval"), pack_documents(eval_docs, SEQ_LEN, tok.pad_token_id))
    assert data.report("eval").to_dict() == eval_report.to_dict()
    every = PreparedData(prepare_data(request(tok, [a], holdout="none"), tok, tmp_path / "n", progress=False))
    assert_same_rows(every.rows("train"), pack_documents(docs, SEQ_LEN, tok.pad_token_id)) and not every.rows("eval")


def test_one_and_three_workers_write_byte_identical_storage(tmp_path, tok):
    # Enough batches (BATCH_RECORDS each) that three workers really share the work, out of order.
    path = write_jsonl(tmp_path / "d.jsonl", mixed_records() * 20)
    one = prepare_data(request(tok, [path]), tok, tmp_path / "one", num_workers=1, progress=False)
    three = prepare_data(request(tok, [path]), tok, tmp_path / "three", num_workers=3, progress=False)
    names = sorted(p.name for p in one.iterdir() if p.name != "stamps.json")
    assert names == sorted(p.name for p in three.iterdir() if p.name != "stamps.json")
    assert "manifest.json" in names and "tokens.bin" in names
    for name in names:
        assert (one / name).read_bytes() == (three / name).read_bytes(), name


def test_disk_cost_is_what_the_planner_prices(tmp_path, tok):
    from dflash_trainer.config import load_config
    from dflash_trainer.planner.report import plan_for_config

    path = write_jsonl(tmp_path / "d.jsonl", conversations(50))
    data = PreparedData(
        prepare_data(request(tok, [path], seq_len=64), tok, tmp_path / "p", num_workers=1, progress=False)
    )
    m = data.manifest
    assert all(r.loss_mask.numel() == 64 for r in data.rows("train"))
    docs = PreparedData(tmp_path / "p").array("doc_offsets")
    assert (np.diff(docs) <= 64).all()  # no document spans rows: one piece each
    cost = plan_for_config(load_config(["tiny-demo"], [f"data.seq_len={64}"])).data
    rows = m["splits"]["train"]["rows"] + m["splits"]["eval"]["rows"]
    predicted = (
        cost["disk_bytes_per_token"] * m["n_tokens"]
        + cost["disk_bytes_per_document"] * m["n_documents"]
        + cost["disk_bytes_per_row"] * rows
    )
    measured = sum(f["bytes"] for f in m["files"].values())
    assert measured == predicted + 24  # + the three offset arrays' leading zeros
    assert cost["disk_bytes_per_full_row"] == 64 * 5 + 8


# ---------------------------------------------------------------- input formats


def test_parquet_arrow_save_to_disk_and_datasets_cache_read_like_jsonl(tmp_path, tok, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the `datasets` package (test extra) writes the folders")
    records = mixed_records()
    # Tables cannot hold a line that is not JSON; every other record (ragged shapes too) goes in as rows.
    rows = [r for r in records if not isinstance(r, str)]
    jsonl_rows = write_jsonl(tmp_path / "rows.jsonl", rows)
    expected = PreparedData(
        prepare_data(request(tok, [jsonl_rows]), tok, tmp_path / "ref", num_workers=1, progress=False)
    )
    ds = datasets.load_dataset("json", data_files=jsonl_rows, split="train", cache_dir=str(tmp_path / "hf-cache"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "saved-dict"))
    cache_folder = Path(ds.cache_files[0]["filename"]).parent  # load_dataset's own cache folder
    arrow_file = next((tmp_path / "saved").glob("*.arrow"))
    sources = {
        "parquet": str(tmp_path / "d.parquet"),
        "arrow": str(arrow_file),
        "save_to_disk": str(tmp_path / "saved"),
        "DatasetDict": str(tmp_path / "saved-dict"),
        "datasets cache": str(cache_folder),
    }
    for kind, source in sources.items():
        data = PreparedData(prepare_data(request(tok, [source]), tok, tmp_path / kind, num_workers=1, progress=False))
        assert_same_rows(data.rows("train"), expected.rows("train"))
        assert_same_rows(data.rows("eval"), expected.rows("eval"))
        report, ref = data.report("train"), expected.report("train")
        assert [(line, reason) for _, line, reason in report.bad] == [(line, r) for _, line, r in ref.bad], kind
    # A Hub name reads the local datasets cache's copy (org___name/config/version/hash), no network.
    hub = tmp_path / "hub-cache" / "someorg___chats" / "default" / "0.0.0" / "abc123"
    hub.mkdir(parents=True)
    for f in cache_folder.iterdir():
        if f.suffix in (".arrow", ".json"):
            (hub / f.name).write_bytes(f.read_bytes())
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hub-cache"))
    data = PreparedData(
        prepare_data(request(tok, ["someorg/chats"]), tok, tmp_path / "hub", num_workers=1, progress=False)
    )
    assert_same_rows(data.rows("train"), expected.rows("train"))
    with pytest.raises(UserError, match=r"someorg/missing .*Hugging Face Hub .*local files only"):
        prepare_data(request(tok, ["someorg/missing"]), tok, tmp_path / "missing", progress=False)


def test_column_mapping_reads_other_names(tmp_path, tok):
    records = conversations(12)
    renamed = [
        {"chat": [{"speaker": m["role"], "text": m["content"]} for m in r["messages"]], "id": i}
        for i, r in enumerate(records)
    ]
    plain = write_jsonl(tmp_path / "plain.jsonl", records)
    other = write_jsonl(tmp_path / "other.jsonl", renamed)
    expected = PreparedData(prepare_data(request(tok, [plain]), tok, tmp_path / "a", num_workers=1, progress=False))
    columns = (("content", "text"), ("messages", "chat"), ("role", "speaker"))
    got = PreparedData(prepare_data(request(tok, [other], columns=columns), tok, tmp_path / "b", progress=False))
    assert_same_rows(got.rows("train"), expected.rows("train"))
    unmapped = PreparedData(prepare_data(request(tok, [other]), tok, tmp_path / "c", progress=False))
    assert unmapped.report("train").counts == {"no messages, conversations or input_ids": 12}


def test_a_line_longer_than_the_limit_is_skipped_without_reading_it_whole(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    records = conversations(4)
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * 300_000}]})
    path.write_text(json.dumps(records[0]) + "\n" + huge + "\n" + "\n".join(json.dumps(r) for r in records[1:]) + "\n")
    items = list(iter_records([str(path)], max_record_bytes=1000))
    assert [type(i).__name__ for i in items] == ["Record", "BadRecord", "Record", "Record", "Record"]
    assert (
        items[1].line == 2
        and items[1].reason == f"record too large: {len(huge) + 1:,} bytes > data.max_record_bytes 1,000"
    )
    assert [i.line for i in items] == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------- reuse, rebuild, refuse


def test_cache_is_reused_then_rebuilt_when_an_input_changes_saying_why(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, conversations(20))
    logs: list[str] = []
    first = ensure_prepared(request(tok, [str(path)]), tok, root=tmp_path / "cache", progress=False, log=logs.append)
    assert "first use" in logs[-1]
    stamp = (first.folder / "tokens.bin").stat().st_mtime_ns
    again = ensure_prepared(request(tok, [str(path)]), tok, root=tmp_path / "cache", progress=False, log=logs.append)
    assert again.folder == first.folder and "reused" in logs[-1]
    assert (again.folder / "tokens.bin").stat().st_mtime_ns == stamp  # not written again
    write_jsonl(path, conversations(25))
    rebuilt = ensure_prepared(request(tok, [str(path)]), tok, root=tmp_path / "cache", progress=False, log=logs.append)
    assert "preparing" in logs[-1] and "again" in logs[-1] and f"{path.resolve()} changed" in logs[-1]
    assert rebuilt.manifest["n_documents"] == 25
    other = ensure_prepared(request(tok, [str(path)], seq_len=32), tok, root=tmp_path / "cache", progress=False)
    assert other.folder != rebuilt.folder  # other settings: another storage, the first one untouched


def test_named_storage_that_does_not_match_the_run_is_refused_naming_the_difference(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", conversations(20))
    folder = prepare_data(request(tok, [path]), tok, tmp_path / "p", progress=False)
    open_prepared(folder, request(tok, [path]))  # matches
    with pytest.raises(UserError, match=r"data.seq_len: prepared with 48, this run has 32"):
        open_prepared(folder, request(tok, [path], seq_len=32))
    other_template = copy.deepcopy(tok)
    other_template.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    with pytest.raises(UserError, match="the tokenizer or its chat template differ"):
        open_prepared(folder, request(other_template, [path]))
    # Without input paths (train from the storage alone) the settings are still compared.
    with pytest.raises(UserError, match="data.seq_len"):
        open_prepared(folder, request(tok, [], seq_len=32), with_inputs=False)
    open_prepared(folder, request(tok, []), with_inputs=False)
    Path(path).write_text(Path(path).read_text() + json.dumps(conversations(1)[0]) + "\n")
    with pytest.raises(UserError, match=r"d.jsonl changed \(size or modification time\)"):
        open_prepared(folder, request(tok, [path]))


def test_truncated_or_corrupt_storage_files_are_one_line_naming_them(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", conversations(20))
    folder = prepare_data(request(tok, [path]), tok, tmp_path / "p", progress=False)
    PreparedData(folder)
    tokens = folder / "tokens.bin"
    original = tokens.read_bytes()
    tokens.write_bytes(original[:-4])
    with pytest.raises(StorageError, match=rf"{tokens} is truncated"):
        PreparedData(folder)
    flipped = bytearray(original)
    flipped[10] ^= 0xFF
    tokens.write_bytes(bytes(flipped))  # same size, new modification time: the sha256 is checked
    with pytest.raises(StorageError, match=rf"{tokens} is corrupt"):
        PreparedData(folder)
    tokens.write_bytes(original)
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(StorageError, match="manifest.json is unreadable or corrupt"):
        PreparedData(folder)


def cli(*args, env=None, timeout=600, process=True):
    """``(exit status, stdout, stderr)``: tests/cli_runs.py's ``run``."""
    return run(*args, env=env, timeout=timeout, process=process)


def test_prepare_data_command_then_train_reads_it_and_verify_finds_corruption(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", conversations(30))
    out = tmp_path / "prepared"
    common = ["--config", "tiny-demo", "--set", f"data.train_files=[{data}]", "--set", "data.seq_len=128"]
    code, stdout, err = cli("prepare-data", *common, "--set", "data.num_workers=2", "--out", str(out))
    assert code == 0, err
    assert "bytes/token" in stdout and f"--set data.prepared={out}" in stdout
    # the rest in this process (tests/cli_runs.py): the process boundary is the first command's
    code, stdout, err = cli("prepare-data", "--verify", str(out), process=False)
    assert code == 0 and "ok" in stdout, err
    # train from the prepared folder alone: no input files named, no tokenizing
    run = tmp_path / "run"
    code, stdout, err = cli(
        "train",
        "--config",
        "tiny-demo",
        "--set",
        f"data.prepared={out}",
        "--set",
        "data.seq_len=128",
        "--set",
        "train.max_steps=1",
        "--set",
        "train.eval_every=1",
        "--set",
        f"output_dir={run}",
        process=False,
    )
    assert code == 0, err
    assert "prepare data" not in stdout and (run / "data_report.json").is_file()
    # a setting the storage was not prepared with is refused before anything is trained
    code, _, err = cli(
        "train", "--config", "tiny-demo", "--set", f"data.prepared={out}", "--set", f"output_dir={run}2", process=False
    )
    assert code == 2 and "data.seq_len: prepared with 128, this run has" in err and len(err.strip().splitlines()) == 1
    loss = out / "loss_mask.bin"
    raw = bytearray(loss.read_bytes())
    raw[0] ^= 1
    loss.write_bytes(bytes(raw))
    code, _, err = cli("prepare-data", "--verify", str(out), process=False)
    assert code == 2 and f"{loss}" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("prepare-data", *common, "--set", "data.train_files=[someorg/no-such-set]", process=False)
    assert code == 2 and "Hugging Face Hub" in err and len(err.strip().splitlines()) == 1

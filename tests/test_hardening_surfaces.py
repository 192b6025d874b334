"""Hostile-but-honest inputs against the newer surfaces (issue 39): prepared data and its cache,
feature caches, foreign drafter folders, variant settings, the vLLM engine and server paths. Each
ends in one error line naming the file or field and the fix (exit 2), or the correct result; never a
traceback, a silent wait or a silent wrong result. Every field of a manifest or foreign config is tried,
not only the one that was found."""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_runs import run

from dflash_trainer.data.prepare import DataRequest, ensure_prepared, prepare_data, tokenizer_fingerprint
from dflash_trainer.data.storage import PreparedData, StorageError
from dflash_trainer.errors import UserError
from dflash_trainer.tiny_target import tiny_target_path

CHAT = {
    "messages": [
        {"role": "user", "content": "Sum a list."},
        {"role": "assistant", "content": "def f(x): return sum(x)"},
    ]
}


def cli(*args, env=None, timeout=300, process=True):
    """``(exit status, stdout, stderr)``: tests/cli_runs.py's ``run``."""
    return run(*args, env=env, timeout=timeout, process=process)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash-train: error: "), err
    return lines[0]


def leaves(value, prefix=()):
    """Every (path, value) of a JSON object, its objects and lists walked."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, (*prefix, k))
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            yield from leaves(v, (*prefix, i))
    else:
        yield prefix, value


def wrong_type(value):
    """A value of another JSON type than ``value``."""
    if isinstance(value, bool) or value is None:
        return "yes"
    if isinstance(value, (int, float)):
        return "many"
    if isinstance(value, str):
        return 7
    return {"a": 1} if isinstance(value, list) else ["a"]


def edited(obj, path, value=None, delete=False):
    obj = copy.deepcopy(obj)
    at = obj
    for k in path[:-1]:
        at = at[k]
    if delete:
        del at[path[-1]]
    else:
        at[path[-1]] = value
    return obj


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_path(), local_files_only=True)


def request(tok, train, seq_len=48) -> DataRequest:
    return DataRequest(
        train_paths=tuple(train),
        eval_paths=(),
        holdout="fraction",
        eval_fraction=0.2,
        seq_len=seq_len,
        min_tokens=5,
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        max_record_bytes=1 << 20,
        tokenizer=tokenizer_fingerprint(tok),
    )


def chats(n):
    return "".join(
        json.dumps({**CHAT, "messages": [CHAT["messages"][0] | {"content": f"task {i}"}, CHAT["messages"][1]]}) + "\n"
        for i in range(n)
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tok):
    tmp = tmp_path_factory.mktemp("prepared")
    (tmp / "d.jsonl").write_text(chats(20))
    return prepare_data(request(tok, [str(tmp / "d.jsonl")]), tok, tmp / "p", num_workers=1, progress=False)


# ---------------------------------------------------------------- prepared data: every manifest field


def _manifest_cases():
    # The fields of a manifest as prepare writes it (the fixture's, read at collection: one case each).
    sample = {
        "format": "f",
        "version": 1,
        "settings": {
            "train_paths": ["a"],
            "eval_paths": [],
            "holdout": "fraction",
            "eval_fraction": 0.2,
            "seq_len": 48,
            "min_tokens": 5,
            "vocab_size": 9,
            "pad_token_id": 0,
            "max_record_bytes": 1,
            "columns": {},
            "tokenizer": "h",
        },
        "inputs": {"train": [{"path": "a", "bytes": 1, "mtime_ns": 1}], "eval": []},
        "splits": {s: {"documents": 1, "rows": 1, "tokens": 1} for s in ("train", "eval")},
        "n_tokens": 1,
        "n_documents": 1,
        "files": {
            n: {"name": "x.bin", "dtype": "int64", "shape": [1], "bytes": 8, "sha256": "s"}
            for n in ("tokens", "loss_mask", "doc_offsets", "train_rows", "train_pieces", "eval_rows", "eval_pieces")
        },
    }
    out = []
    for path, _ in leaves(sample):
        if path[0] in ("format", "version"):
            continue  # their own messages (another format, another version), tested elsewhere
        out.append(pytest.param(path, "wrong", id="wrong-" + ".".join(map(str, path))))
        if not isinstance(path[-1], int):
            out.append(pytest.param(path, "missing", id="missing-" + ".".join(map(str, path))))
    return out


@pytest.mark.parametrize("path, damage", _manifest_cases())
def test_every_prepared_manifest_field_of_the_wrong_type_or_missing_is_one_line(prepared, tmp_path, path, damage):
    folder = tmp_path / "p"
    shutil.copytree(prepared, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    if path[0] == "inputs" and path[1] == "eval" and not manifest["inputs"]["eval"]:
        path = path[:2]  # an empty list has no items: the list itself
    if damage == "missing":
        manifest = edited(manifest, path, delete=True)
    else:
        at = manifest
        for k in path:
            at = at[k]
        manifest = edited(manifest, path, wrong_type(at))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        StorageError, match=rf"manifest {folder / 'manifest.json'}: field .*prepare the data again"
    ) as e:
        PreparedData(folder).rows("train")[0]
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["tokens", "train_pieces", "doc_offsets"])
def test_a_manifest_shape_larger_than_the_file_is_one_line_not_an_mmap_error(prepared, tmp_path, name):
    folder = tmp_path / "p"
    shutil.copytree(prepared, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name]["shape"][0] += 1000
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StorageError, match=rf"field files.{name} is inconsistent"):
        PreparedData(folder)


def test_verify_of_a_manifest_without_splits_is_one_line(prepared, tmp_path):
    folder = tmp_path / "p"
    shutil.copytree(prepared, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["splits"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = cli("prepare-data", "--verify", str(folder))
    assert code == 2 and "field splits" in one_error_line(err)


def test_bit_rotted_tokens_with_their_mtime_kept_are_caught_where_rows_enter_training(prepared, tmp_path):
    folder = tmp_path / "p"
    shutil.copytree(prepared, folder, copy_function=shutil.copy2)
    tokens = folder / "tokens.bin"
    st = tokens.stat()
    raw = bytearray(tokens.read_bytes())
    raw[0:4] = np.uint32(4_000_000_000).tobytes()  # the first token of the first document
    tokens.write_bytes(bytes(raw))
    os.utime(tokens, ns=(st.st_atime_ns, st.st_mtime_ns))
    # stamps.json still matches: opening skips the sha256; the row is refused when it is read
    data = PreparedData(folder)
    rows = data.rows("train")
    bad = [i for i in range(len(rows)) if int(rows.pieces[rows.offsets[i], 0]) == 0][0]
    with pytest.raises(StorageError, match=rf"{tokens} is corrupt: row {bad} holds token id 4000000000.*--verify"):
        rows[bad]


def test_prepare_data_out_naming_a_file_is_one_line(tmp_path):
    (tmp_path / "d.jsonl").write_text(chats(10))
    (tmp_path / "f").write_text("x")
    code, _, err = cli(
        "prepare-data",
        "--config",
        "tiny-demo",
        "--set",
        f"data.train_files=[{tmp_path / 'd.jsonl'}]",
        "--out",
        str(tmp_path / "f"),
    )
    assert code == 2 and "--out" in one_error_line(err) and "is a file, not a folder" in err


def _mount(path: Path, ro: bool):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    opts = ("remount,ro" if ro else "remount,rw") if path.is_mount() else "size=4m"
    args = (
        ["mount", "-o", opts, str(path)]
        if path.is_mount()
        else ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)]
    )
    if subprocess.run(args).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")


def test_a_read_only_cache_is_used_when_it_holds_the_data_and_named_when_it_does_not(tmp_path, tok):
    data = tmp_path / "d.jsonl"
    data.write_text(chats(20))
    cache = tmp_path / "cache"
    cache.mkdir()
    _mount(cache, ro=False)
    try:
        _mount(cache, ro=True)  # empty and read-only: nothing to use, nothing can be written
        with pytest.raises(UserError, match=rf"the data cache {cache} is not writable .*set data.cache_dir"):
            ensure_prepared(request(tok, [str(data)]), tok, root=cache, progress=False, log=lambda _: None)
        _mount(cache, ro=False)
        first = ensure_prepared(request(tok, [str(data)]), tok, root=cache, progress=False, log=lambda _: None)
        _mount(cache, ro=True)  # a filled shared mount: used as it is
        logs = []
        again = ensure_prepared(request(tok, [str(data)]), tok, root=cache, progress=False, log=logs.append)
        assert again.folder == first.folder and "read-only cache" in logs[-1] and len(again.rows("train")) > 0
        with pytest.raises(UserError, match="is not writable"):  # other settings: not there, cannot be made
            ensure_prepared(request(tok, [str(data)], seq_len=32), tok, root=cache, progress=False, log=lambda _: None)
    finally:
        subprocess.run(["umount", "-l", str(cache)], check=False)


def test_a_killed_prepare_data_leaves_no_temporary_folder_after_the_next_start(tmp_path, tok):
    data = tmp_path / "d.jsonl"
    data.write_text(chats(2000))
    cache = tmp_path / "cache"
    code = (
        "import sys, time; from dflash_trainer.data import prepare as p; "
        "from transformers import AutoTokenizer; from dflash_trainer.tiny_target import tiny_target_path\n"
        "tok = AutoTokenizer.from_pretrained(tiny_target_path(), local_files_only=True)\n"
        "req = p.DataRequest(train_paths=(sys.argv[1],), eval_paths=(), holdout='fraction', eval_fraction=0.2, seq_len=48,"
        " min_tokens=5, vocab_size=len(tok), pad_token_id=tok.pad_token_id, max_record_bytes=1 << 20,"
        " tokenizer=p.tokenizer_fingerprint(tok))\n"
        "orig = p.tokenize_batch\n"
        "def slow(batch):\n    print('writing', flush=True); time.sleep(60); return orig(batch)\n"
        "p.tokenize_batch = slow\n"
        "p.ensure_prepared(req, tok, root=sys.argv[2], num_workers=1, progress=False)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(data), str(cache)], stdout=subprocess.PIPE, text=True)
    try:
        assert "writing\n" in iter(proc.stdout.readline, "")  # it is writing its temporary folder
    finally:
        proc.kill()
        proc.wait()
    left = [p for p in cache.iterdir() if p.is_dir()]
    assert len(left) == 1 and left[0].name.startswith(".")  # the killed run's temporary folder
    # the next start, even with other settings (another cache key), removes the dead writer's folder
    other = request(tok, [str(data)], seq_len=32)
    ensure_prepared(other, tok, root=cache, num_workers=1, progress=False, log=lambda _: None)
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [other.key()]


# ---------------------------------------------------------------- foreign drafter folders: every field read

LAYER = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "sliding_window": None,
    "use_sliding_window": False,
    "layer_types": ["full_attention", "full_attention"],
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}
ZLAB = {
    **LAYER,
    "architectures": ["DFlashDraftModel"],
    "num_target_layers": 8,
    "block_size": 8,
    "dflash_config": {
        "mask_token_id": 3,
        "target_layer_ids": [1, 3, 5],
        "block_size": 8,
        "output_multiplier": 1.0,
        "final_logit_softcapping": None,
        "input_embedding_scale": 1.0,
        "causal_in_block_sliding": False,
        "target_model_path": "t",
        "pure_draft_prefix_len": 0,
        "shift_label": False,
    },
}
SPECULATORS = {
    "speculators_model_type": "dflash",
    "transformer_layer_config": LAYER,
    "aux_hidden_state_layer_ids": [2, 4, 6],
    "mask_token_id": 3,
    "draft_vocab_size": 8192,
    "block_size": 8,
    "sliding_window_non_causal": False,
    "sample_from_anchor": False,
    "speculators_config": {"verifier": {"name_or_path": "t"}},
}


def _foreign_cases():
    out = []
    for fmt, cfg in (("zlab", ZLAB), ("speculators", SPECULATORS)):
        for path, _ in leaves(cfg):
            if path in (("speculators_model_type",), ("architectures", 0)):
                continue  # what says which reader applies
            out.append(
                pytest.param(
                    fmt, path[:-1] if isinstance(path[-1], int) else path, id=f"{fmt}-" + ".".join(map(str, path))
                )
            )
    return out


@pytest.mark.parametrize("fmt, path", _foreign_cases())
def test_every_foreign_config_field_of_the_wrong_type_is_one_line_naming_it(tmp_path, fmt, path):
    from dflash_trainer.export.layouts import read_drafter_folder

    cfg = ZLAB if fmt == "zlab" else SPECULATORS
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    read_drafter_folder(tmp_path)  # the good folder reads
    at = cfg
    for k in path:
        at = at[k]
    (tmp_path / "config.json").write_text(json.dumps(edited(cfg, path, wrong_type(at))))
    with pytest.raises(
        UserError, match=rf"config.json: field {'.'.join(map(str, path))}\b.*export the drafter again"
    ) as e:
        read_drafter_folder(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit", [{"block_size": "eight"}, {"dflash_config": "x"}])
def test_a_damaged_foreign_config_through_export_check_is_exit_2_with_one_line(tmp_path, edit):
    (tmp_path / "config.json").write_text(json.dumps({**ZLAB, **edit}))
    code, _, err = cli("export", "--check", str(tmp_path), process="block_size" in edit)  # the first as a process
    assert code == 2 and f"field {next(iter(edit))}" in one_error_line(err)


# ---------------------------------------------------------------- feature caches: every manifest field


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("features")
    (tmp / "d.jsonl").write_text(chats(20))
    code, _, err = cli(
        "capture",
        "--config",
        "tiny-demo",
        "--no-progress",
        "--out",
        str(tmp / "f"),
        "--set",
        f"data.train_files=[{tmp / 'd.jsonl'}]",
        "--set",
        "data.seq_len=48",
        env={"DFLASH_DATA_CACHE": str(tmp / "cache")},
    )
    assert code == 0, err
    return tmp / "f"


def _cache_cases():
    sample = {
        "settings": {"storage_dtype": "float32", "teacher": True, "layer_ids": [1], "seq_len": 1, "hidden_size": 1},
        "target": {},
        "data": {},
        "splits": {"train": 1},
        "row_bytes": {"train": 1},
        "rows_per_shard": 1,
        "key": "k",
    }
    shard = {"rows": [0], "bytes": 1, "sha256": "s", "stamp": [1, 2]}
    out = []
    for file, fields in (("capture.json", sample), ("manifest.json", {**sample, "bytes": 1, "shards": {"S": shard}})):
        for path, _ in leaves(fields):
            path = path[:-1] if isinstance(path[-1], int) else path
            out.append(pytest.param(file, path, "wrong", id=f"{file}-wrong-" + ".".join(map(str, path))))
            if path[-1] not in ("target", "data") and path[0] not in ("splits", "row_bytes"):  # maps, not fields
                out.append(pytest.param(file, path, "missing", id=f"{file}-missing-" + ".".join(map(str, path))))
    return list({p.id: p for p in out}.values())


@pytest.mark.parametrize("file, path, damage", _cache_cases())
def test_every_feature_cache_field_of_the_wrong_type_or_missing_is_one_line(features, tmp_path, file, path, damage):
    from dflash_trainer.features.store import CacheError, FeatureStore

    folder = tmp_path / "f"
    shutil.copytree(features, folder)
    value = json.loads((folder / file).read_text())
    if path[0] == "shards":
        path = ("shards", next(iter(value["shards"])), *path[2:])
    if path[0] == "splits":
        path = ("splits", "train")
    at = value
    for k in path:
        at = at[k]
    value = edited(value, path, delete=True) if damage == "missing" else edited(value, path, wrong_type(at))
    (folder / file).write_text(json.dumps(value))
    with pytest.raises(
        CacheError, match=rf"{file}: field {'.'.join(map(str, path))}\b.*(capture again|rewrite it)"
    ) as e:
        FeatureStore(folder)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- our own checkpoint, speculate's numbers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    (tmp / "d.jsonl").write_text(chats(20))
    code, _, err = cli(
        "train",
        "--config",
        "tiny-demo",
        "--no-progress",
        "--set",
        f"data.train_files=[{tmp / 'd.jsonl'}]",
        "--set",
        "data.seq_len=48",
        "--set",
        "train.max_steps=1",
        "--set",
        "drafter.num_layers=1",
        "--set",
        f"output_dir={tmp / 'run'}",
        env={"DFLASH_DATA_CACHE": str(tmp / "cache")},
        process=False,  # a checkpoint to damage: no process boundary is checked here
    )
    assert code == 0, err
    return tmp / "run" / "checkpoints" / "step-0000001", tmp / "d.jsonl"


def test_a_truncated_drafter_safetensors_in_our_checkpoint_is_one_line(checkpoint, tmp_path):
    ckpt, data = checkpoint
    damaged = tmp_path / "ckpt"
    shutil.copytree(ckpt, damaged)
    weights = damaged / "drafter.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    code, _, err = cli(
        "speculate",
        "--drafter",
        str(damaged),
        "--input",
        str(data),
        "--output",
        str(tmp_path / "o.jsonl"),
        "--max-new-tokens",
        "4",
        "--limit",
        "1",
    )
    assert code == 2 and f"checkpoint weights {weights} cannot be read" in one_error_line(err)


@pytest.mark.parametrize(
    "flag, value", [("--confidence-threshold", "nan"), ("--temperature", "nan"), ("--temperature", "inf")]
)
def test_speculate_numbers_that_are_not_numbers_are_refused(checkpoint, tmp_path, flag, value):
    ckpt, data = checkpoint
    first = flag == "--confidence-threshold"  # the first case as its own process
    code, _, err = cli(
        "speculate",
        "--drafter",
        str(ckpt),
        "--input",
        str(data),
        "--output",
        str(tmp_path / "o.jsonl"),
        flag,
        value,
        process=first,
    )
    assert code == 2 and f"{flag} must be" in one_error_line(err) and value in err


# ---------------------------------------------------------------- vLLM engine and --server


def generate(tmp_path, *args, env=None, timeout=120, process=True):
    (tmp_path / "in.jsonl").write_text(chats(2))
    return cli(
        "generate",
        "--config",
        "tiny-demo",
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output",
        str(tmp_path / "out.jsonl"),
        "--no-progress",
        *args,
        env=env,
        timeout=timeout,
        process=process,
    )


def test_a_vllm_python_that_is_not_executable_is_one_line_before_any_work(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o644)
    code, _, err = generate(tmp_path, "--engine", "vllm", env={"DFLASH_VLLM_PYTHON": str(python)})
    assert code == 2 and f"DFLASH_VLLM_PYTHON={python} is not executable" in one_error_line(err)


class _Listener:
    """A real TCP server on 127.0.0.1 that answers every connection with ``answer(request bytes)`` (None:
    accept and never answer)."""

    def __init__(self, answer):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer, self.held = answer, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            request = conn.recv(65536)
            reply = self.answer(request)
            if reply is None:
                self.held.append(conn)  # accepted, never answered
                continue
            conn.sendall(reply)
            conn.close()

    def close(self):
        self.sock.close()
        for c in self.held:
            c.close()


def _http(body: bytes, ctype="application/json") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype.encode() + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )


MODELS = _http(b'{"object": "list", "data": [{"id": "tiny", "object": "model"}]}')


@pytest.mark.parametrize(
    "answer, needle",
    [
        (lambda r: _http(b"<html><body>Welcome to nginx</body></html>", "text/html"), "not JSON ('<html>"),
        (lambda r: _http(b'{"data": [{"object": "model"}]}'), "/v1/models: field data.0.id"),
        (lambda r: _http(b'{"data": "tiny"}'), "/v1/models: field data"),
        (lambda r: b"SSH-2.0-OpenSSH_9.6\r\n", "did not answer /v1/models in HTTP"),
        (lambda r: MODELS if b"/v1/models" in r else _http(b'{"choices": []}'), "/v1/completions: field choices"),
        (lambda r: MODELS if b"/v1/models" in r else _http(b'{"choices": [{"text": 5}]}'), "field choices.0.text"),
        (lambda r: None, "did not answer /v1/models within 2 s"),
    ],
    ids=["html", "model-without-id", "data-a-string", "not-http", "no-choices", "text-a-number", "never-answers"],
)
def test_generate_server_that_is_not_an_openai_server_is_one_line(tmp_path, answer, needle):
    import time

    server = _Listener(answer)
    try:
        t0 = time.monotonic()
        first = needle.startswith("not JSON")  # the first case as its own process
        code, _, err = generate(tmp_path, "--server", server.url, env={"DFLASH_SERVER_TIMEOUT": "2"}, process=first)
        assert code == 2 and needle in one_error_line(err) and server.url in err
        assert time.monotonic() - t0 < 60  # named, not waited on
    finally:
        server.close()


@pytest.mark.parametrize("value", ["soon", "0", "-1", "inf"])
def test_a_server_timeout_that_is_no_positive_number_is_one_line(tmp_path, value):
    """DFLASH_SERVER_TIMEOUT is read when a server is probed (it once was read at import: a word there was
    a ValueError traceback from importing the engines)."""
    code, _, err = generate(
        tmp_path, "--server", "http://127.0.0.1:9", env={"DFLASH_SERVER_TIMEOUT": value}, process=False
    )
    assert code == 2 and "DFLASH_SERVER_TIMEOUT must be a" in one_error_line(err) and repr(value) in err


# ---------------------------------------------------------------- silent wrong results


def test_an_input_edited_in_place_with_size_and_mtime_kept_is_prepared_again(tmp_path, tok):
    data = tmp_path / "d.jsonl"
    data.write_text(chats(20))
    logs = []
    first = ensure_prepared(request(tok, [str(data)]), tok, root=tmp_path / "c", progress=False, log=logs.append)
    st = data.stat()
    data.write_text(data.read_text().replace("task 1", "TASK 1"))  # same size, other tokens
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert data.stat().st_size == st.st_size
    again = ensure_prepared(request(tok, [str(data)]), tok, root=tmp_path / "c", progress=False, log=logs.append)
    assert "preparing" in logs[-1] and "changed (its first or last 64 KiB)" in logs[-1]
    assert again.folder == first.folder
    assert again.rows("train")[0] is not None


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["drafter.dspark.markov_rank=8"], "drafter.dspark.markov_rank is set but drafter.variant is dflash"),
        (["drafter.dflash2.selector_top_k=4"], "drafter.dflash2.selector_top_k is set but drafter.variant is dflash"),
        (
            ["drafter.variant=dspark", "drafter.dflash2.conv_kernel_size=3"],
            "drafter.dflash2.conv_kernel_size is set but drafter.variant is dspark",
        ),
        (
            ["drafter.variant=dflash2", "drafter.dspark.sample_from_anchor=false"],
            "drafter.dspark.sample_from_anchor is set but drafter.variant is dflash2",
        ),
        (["data.features=/f", "data.prepared=/p"], "data.features and data.prepared are both set"),
    ],
)
def test_settings_that_would_be_ignored_are_refused_naming_them(tmp_path, overrides, needle):
    from dflash_trainer.config import load_config
    from dflash_trainer.config.loader import ConfigError

    with pytest.raises(ConfigError, match=needle):
        load_config(["tiny-demo"], overrides)
    sets = [a for o in overrides for a in ("--set", o)]
    first = needle.startswith("drafter.dspark.markov_rank")  # the first case as its own process
    code, _, err = cli(
        "train", "--config", "tiny-demo", *sets, "--set", f"output_dir={tmp_path / 'run'}", process=first
    )
    assert code == 2 and needle in one_error_line(err)
    assert "(from --set " in err  # the setting's source, not the preset that holds its section


@pytest.mark.parametrize("preset", ["tiny-demo", "tiny-demo-dspark", "tiny-demo-dflash2"])
def test_a_resolved_run_yaml_of_each_variant_loads_again(tmp_path, preset):
    from dflash_trainer.config import load_config, write_resolved_config

    path = write_resolved_config(load_config([preset]), tmp_path / "run")
    assert load_config([str(path)]) == load_config([preset])


# ---------------------------------------------------------------- DFlash2 on more than one thread


def test_dflash2_selector_codebook_gradients_are_the_same_on_every_run_at_two_threads():
    """Indexing a parameter (``W[ids]``) backpropagates through index_put_ with atomic float adds on more
    than one CPU thread: sums in another order each run. The selector reads its codebooks with
    F.embedding, whose backward is deterministic."""
    import torch

    from dflash_trainer.variants.dflash2.modules import CandidateSelector

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        selector = CandidateSelector(vocab=8192, hidden=64, rank=64, top_k=16)
        hidden, prev = torch.randn(4096, 64), torch.randint(0, 40, (4096,))
        candidates = torch.randint(0, 40, (4096, 16))

        def grads():
            selector.zero_grad()
            selector.transition(selector.context(hidden, prev), candidates).square().sum().backward()
            return [p.grad.clone() for p in (selector.predecessor_codebook, selector.successor_codebook)]

        first = grads()
        for _ in range(5):
            assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    finally:
        torch.set_num_threads(threads)


def test_two_dflash2_runs_and_a_resume_at_two_threads_have_bit_identical_losses(tmp_path):
    import torch
    from test_train import SMALL, write_data

    from dflash_trainer.config import load_config
    from dflash_trainer.training.setup import prepare
    from dflash_trainer.training.trainer import Trainer

    data = write_data(tmp_path / "data.jsonl", n=8)
    common = [
        *SMALL,
        f"data.train_files=[{data}]",
        "drafter.variant=dflash2",
        "drafter.dflash2.selector_rank=128",
        "data.max_anchors=32",
        "train.max_steps=6",  # a sum in another order changes step 2's loss (the update of step 1)
        "train.eval_every=6",
        "train.save_every=3",
    ]

    def losses(out):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prepared = None
        for name, resume in (("a", None), ("b", None), ("resumed", "a")):
            cfg = load_config(["tiny-demo"], [*common, f"output_dir={tmp_path / name}"])
            prepared = prepared or prepare(cfg)
            target, tok, rows, eval_rows, _ = prepared
            trainer = Trainer(
                cfg, target, tok, rows, eval_rows, out_dir=tmp_path / name, target_path="tiny", progress=False
            )
            trainer.fit(resume=str(tmp_path / resume / "checkpoints" / "step-0000003") if resume else None)
    finally:
        torch.set_num_threads(threads)
    a, b, resumed = (losses(tmp_path / n) for n in ("a", "b", "resumed"))
    assert len(a) == 6 and a == b  # the same run twice: the same bits
    assert sorted(resumed) == list(range(4, 7)) and all(resumed[s] == a[s] for s in resumed)


def test_bit_rotted_token_ids_in_a_feature_shard_are_caught_where_rows_enter_training(features, tmp_path):
    import struct

    from dflash_trainer.features.store import CacheError, FeatureStore

    folder = tmp_path / "f"
    shutil.copytree(features, folder, copy_function=shutil.copy2)
    shard = folder / "shards" / "train-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    key = next(k for k in header if k.endswith(".input_ids"))
    start = 8 + n + header[key]["data_offsets"][0]
    raw[start : start + 4] = struct.pack("<i", 2_000_000_000)
    st = shard.stat()
    shard.write_bytes(bytes(raw))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # its record's size and time still match
    store = FeatureStore(folder)
    row = int(key.split(".")[0])
    with pytest.raises(CacheError, match=rf"{shard} is corrupt: row {row} holds token id 2000000000"):
        store.rows("train")[row]


@pytest.mark.parametrize(
    "edit", [{"trained_layer_ids": "1,3,5"}, {"trained_layer_ids": None}, {"step": "six"}, "{not json"]
)
def test_a_damaged_export_info_is_one_line(tmp_path, edit):
    from dflash_trainer.export.formats import read_export_info

    info = {"format": "x", "trained_layer_ids": [1, 3, 5], "checkpoint": "c", "step": 6, "allowed_mismatches": []}
    text = edit if isinstance(edit, str) else json.dumps({**info, **edit})
    (tmp_path / "export_info.json").write_text(text)
    with pytest.raises(UserError, match=r"export_info.json.*export the drafter again") as e:
        read_export_info(tmp_path)
    assert "\n" not in str(e.value)


CHECKPOINT_FIELDS = [
    *[
        ("spec", f)
        for f in (
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "num_layers",
            "num_features",
            "block_size",
            "rms_norm_eps",
            "rope_theta",
            "sliding_window_layers",
            "sliding_window",
            "causal_in_block_sliding",
            "noise",
            "noise_scale",
            "mask_token_id",
            "activation_checkpointing",
            "logit_scale",
            "logit_softcap",
        )
    ],
    ("spec",),
    ("target",),
    ("target", "layer_ids"),
    ("target", "num_layers"),
    ("target", "path"),
    ("step",),
]


@pytest.mark.parametrize("path", CHECKPOINT_FIELDS, ids=[".".join(p) for p in CHECKPOINT_FIELDS])
def test_every_checkpoint_config_field_of_the_wrong_type_is_one_line(checkpoint, tmp_path, path):
    from dflash_trainer.drafter_folder import CONFIG, read_checkpoint_config

    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint[0], folder)
    meta = json.loads((folder / CONFIG).read_text())
    at = meta
    for k in path:
        at = at[k]
    (folder / CONFIG).write_text(json.dumps(edited(meta, path, wrong_type(at))))
    with pytest.raises(UserError, match=rf"{CONFIG}: .*field (\S+\.)?{path[-1]}\b.*(use another|damaged)") as e:
        read_checkpoint_config(folder)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("stamps", ["[]", '"x"', "{not json", '{"tokens": 5}'])
def test_a_damaged_stamps_json_only_costs_a_sha256_check(prepared, tmp_path, stamps):
    folder = tmp_path / "p"
    shutil.copytree(prepared, folder)
    (folder / "stamps.json").write_text(stamps)
    assert len(PreparedData(folder).rows("train")) > 0


def test_eval_temperature_nan_is_refused(checkpoint, tmp_path):
    ckpt, data = checkpoint
    code, _, err = cli("eval", str(ckpt), "--data", str(data), "--out", str(tmp_path / "e"), "--temperature", "nan")
    assert code == 2 and "--temperature must be >= 0, got nan" in one_error_line(err)


@pytest.mark.parametrize(
    "args",
    [
        ["export", "--check", "FOLDER", "--serve", "vllm", "--limit", "0"],
        ["export", "--check", "FOLDER", "--serve", "vllm", "--max-new-tokens", "-1"],
        ["speculate", "--drafter", "D", "--input", "I", "--output", "O", "--limit", "0"],
        ["generate", "--input", "I", "--output", "O", "--max-new-tokens", "0"],
    ],
)
def test_counts_below_one_are_refused_before_any_work(args):
    """A count of prompts or tokens below 1 is one argparse line (exit 2) naming the option, before any
    file is read: `export --serve --limit 0` used to decode every prompt of its input."""
    status, out, err = cli(*args, process=False)
    option = args[-2]
    assert status == 2 and f"argument {option}: must be >= 1" in err, err
    assert "Traceback" not in err and out == ""


# ---------------------------------------------------------------- one folder kind named where another is expected


def test_prepare_data_out_naming_a_feature_cache_is_refused_and_the_cache_kept(features, tmp_path):
    """A feature cache has a manifest.json too: ``prepare-data --out`` replaced such a folder with the
    prepared data (exit 0), deleting the cache (capture.json and every shard); it is refused, and kept."""
    cache = tmp_path / "f"
    shutil.copytree(features, cache)
    before = sorted(p.relative_to(cache) for p in cache.rglob("*"))
    (tmp_path / "d.jsonl").write_text(chats(4))
    code, _, err = cli(
        "prepare-data", "--config", "tiny-demo", "--set", f"data.train_files=[{tmp_path / 'd.jsonl'}]",
        "--out", str(cache), process=False,
    )  # fmt: skip
    assert code == 2 and f"--out {cache} exists and is not prepared data (it holds a feature cache)" in one_error_line(
        err
    )
    assert sorted(p.relative_to(cache) for p in cache.rglob("*")) == before
    code, _, err = cli("capture", "--verify", str(cache), "--no-progress", process=False)
    assert code == 0, err


def test_data_prepared_naming_a_feature_cache_says_what_it_is(features, prepared, tmp_path):
    """The other way round too: each folder kind is named, with the setting that reads it."""
    (tmp_path / "d.jsonl").write_text(chats(4))
    code, _, err = cli(
        "train", "--config", "tiny-demo", "--no-progress", "--set", f"data.train_files=[{tmp_path / 'd.jsonl'}]",
        "--set", f"data.prepared={features}", "--set", f"output_dir={tmp_path / 'run'}", process=False,
    )  # fmt: skip
    assert code == 2
    assert f"{features} is a feature cache (dflash-train capture), not prepared data: train from it with --set " in (
        one_error_line(err)
    )
    code, _, err = cli("capture", "--verify", str(prepared), "--no-progress", process=False)
    assert code == 2 and f"{prepared} holds no feature cache (no capture.json)" in one_error_line(err)


@pytest.mark.parametrize("kind", ["run folder", "export", "empty"])
def test_resume_naming_a_folder_that_is_no_checkpoint_says_so(checkpoint, tmp_path, kind):
    """``--resume PATH`` on a folder with none of a checkpoint's files used to blame an incomplete write
    ("no checksums.json (incomplete write)"); a torn checkpoint still gets that line."""
    ckpt, data = checkpoint
    folder = tmp_path / kind.replace(" ", "-")
    folder.mkdir()
    if kind == "run folder":  # the run's own folder: run.yaml and checkpoints/ in it
        shutil.copy(ckpt / "run.yaml", folder / "run.yaml")
        (folder / "checkpoints").mkdir()
    elif kind == "export":
        (folder / "config.json").write_text("{}")
    args = ["train", "--config", "tiny-demo", "--no-progress", "--set", f"data.train_files=[{data}]"]
    args += ["--set", "data.seq_len=48", "--set", f"output_dir={tmp_path / 'out'}", "--resume", str(folder)]
    code, _, err = cli(*args, env={"DFLASH_DATA_CACHE": str(ckpt.parents[3] / "cache")}, process=False)
    line = one_error_line(err)
    assert code == 2 and f"--resume {folder} is not a training checkpoint: none of checksums.json" in line
    assert ("its checkpoints are under checkpoints/" in line) == (kind == "run folder")
    torn = tmp_path / "torn"
    shutil.copytree(ckpt, torn)
    (torn / "checksums.json").unlink()
    code, _, err = cli(*args[:-1], str(torn), env={"DFLASH_DATA_CACHE": str(ckpt.parents[3] / "cache")}, process=False)
    assert code == 2 and f"checkpoint {torn} cannot be resumed: no checksums.json (incomplete write)" in one_error_line(
        err
    )


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "localhost:8000/v1", "ftp://127.0.0.1:21", "http://"])
def test_a_server_url_that_is_no_http_url_is_named_as_such(tmp_path, url):
    """``--server 127.0.0.1:8000`` (no scheme) was "cannot reach the server ...: unknown url type": the
    server was never asked; the URL is what is wrong."""
    code, _, err = generate(tmp_path, "--server", url, process=False)
    assert code == 2 and f"--server {url} is not an http(s) URL: write it as http://HOST:PORT" in one_error_line(err)


def test_export_check_of_a_checkpoint_says_it_is_no_export(checkpoint):
    """``export --check`` takes an export; on this project's own checkpoint it said "is not a drafter
    folder (no config.json)", though it is one: the line says what to do."""
    ckpt, _ = checkpoint
    code, _, err = cli("export", "--check", str(ckpt), process=False)
    assert code == 2 and f"{ckpt} is a dflash-trainer checkpoint, not an export: export it first" in one_error_line(err)

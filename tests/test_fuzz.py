"""Fuzzing (issue 15): arbitrary record lines and config values end in a result or one error line.

Records: any bytes on a line become a ``Record`` or a counted ``BadRecord`` with its line number, and
a whole file becomes documents or a ``UserError``. Config: any ``--set KEY=VALUE`` and any YAML file
through the real ``dflash-train config`` entry point exits 0, or 2 with exactly one line on stderr.
Never another exception, never a hang: each example runs under an alarm. The example counts are
bounded so the whole file stays within seconds."""

import contextlib
import json
import signal
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_trainer.cli import main
from dflash_trainer.config.loader import valid_keys
from dflash_trainer.data.documents import load_documents
from dflash_trainer.data.records import BadRecord, Record, iter_records
from dflash_trainer.errors import UserError
from dflash_trainer.tiny_target import tiny_target_path

EXAMPLE_SECONDS = 20  # far above any example's real time on a busy 2-core machine; a hang trips it
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@contextlib.contextmanager
def alarm(seconds: int = EXAMPLE_SECONDS):
    def hang(*_):
        raise TimeoutError(f"no result within {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_path(), local_files_only=True)


# ---------------------------------------------------------------- records

texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=40) | st.sampled_from(
    ["", " ", "\r", "\u2028", "\ufeff", "<|im_end|>", "<|MASK|>", "\x00", "a" * 300]
)
roles = st.sampled_from(["user", "assistant", "system", "tool", "gpt", "human", "robot", "", 3, None])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
turn = st.fixed_dictionaries({"role": roles, "content": texts | json_values}) | json_values
chat_record = st.fixed_dictionaries({"messages": st.lists(turn, max_size=4)}, optional={"id": json_values})
sharegpt_record = st.fixed_dictionaries(
    {"conversations": st.lists(st.fixed_dictionaries({"from": roles, "value": texts}), max_size=4)}
)
token_record = st.fixed_dictionaries(
    {"input_ids": st.lists(st.integers(-5, 200_000) | json_values, max_size=20)},
    optional={"loss_mask": st.lists(st.integers(-1, 2) | st.booleans(), max_size=20)},
)


def encode(obj, mangle: int) -> bytes:
    """A record as one line, sometimes mangled the way files get damaged."""
    raw = json.dumps(obj, ensure_ascii=mangle % 2 == 0, allow_nan=True).encode("utf-8", "surrogatepass")
    if mangle % 7 == 3:
        raw = raw[: len(raw) // 2]  # torn
    if mangle % 11 == 5:
        raw = raw.replace(b'"', b"\xff", 1)  # invalid UTF-8
    return raw


lines = st.lists(
    st.tuples(chat_record | sharegpt_record | token_record | json_values, st.integers(0, 76)).map(lambda t: encode(*t))
    | st.binary(max_size=60),
    min_size=1,
    max_size=6,
)


@FUZZ
@given(lines=lines, bom=st.booleans())
def test_any_record_lines_become_records_or_counted_skips(tmp_path_factory, tok, lines, bom):
    path = tmp_path_factory.mktemp("fuzz") / "x.jsonl"
    body = b"\n".join(lines) + b"\n"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + body)
    with alarm():
        items = list(iter_records([str(path)]))
        assert all(isinstance(r, (Record, BadRecord)) for r in items)
        # Line numbers are those of the file's "\n"-separated lines (a BOM before line 1 ignored), blank
        # ones skipped.
        file_lines = path.read_bytes().split(b"\n")
        file_lines[0] = file_lines[0].removeprefix(b"\xef\xbb\xbf")
        assert [r.line for r in items] == [i for i, line in enumerate(file_lines, 1) if line.strip()]
        try:
            docs, report = load_documents(
                [str(path)],
                tok,
                vocab_size=len(tok),
                min_tokens=2,
                max_bad_fraction=1.0,
                report_path=path.with_suffix(".json"),
            )
        except UserError as exc:
            assert "\n" not in str(exc)
        else:
            assert report.n_records == len(items) and len(docs) + report.n_bad == len(items)


# ---------------------------------------------------------------- config values and files

keys = st.sampled_from(valid_keys()) | st.text(string.ascii_lowercase + "._", min_size=1, max_size=12)
raw_values = (
    st.sampled_from(
        [".inf", "-.inf", ".nan", "nan", "1e999", "-0", "[1, 2", "{a: 1}", "*x", "&a 1", "!!python/none", "~"]
    )
    | st.text(max_size=20)
    | st.integers().map(str)
    | st.floats().map(str)
    | json_values.map(json.dumps)
)


def run_cli(capsys, argv) -> tuple[int, str]:
    with alarm():
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own usage errors
            code = exc.code
    return code, capsys.readouterr().err


@FUZZ
@given(settings_=st.lists(st.tuples(keys, raw_values), min_size=1, max_size=3))
def test_any_override_exits_0_or_2_with_one_line(capsys, settings_):
    argv = ["config", "--config", "tiny-demo"]
    for key, value in settings_:
        argv += ["--set", f"{key}={value}"]
    code, err = run_cli(capsys, argv)
    assert code in (0, 2), (code, err)
    if code == 2 and not err.startswith("usage:"):
        assert len(err.strip().splitlines()) == 1 and err.startswith("dflash-train: error: "), err


yaml_text = st.text(max_size=200) | st.lists(
    st.tuples(keys, raw_values).map(lambda kv: f"{'  ' * (kv[0].count('.') > 0)}{kv[0].split('.')[-1]}: {kv[1]}"),
    max_size=6,
).map("\n".join)


@FUZZ
@given(text=yaml_text)
def test_any_config_file_exits_0_or_2_with_one_line(tmp_path_factory, capsys, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    code, err = run_cli(capsys, ["config", "--config", str(path)])
    assert code in (0, 2), (code, err)
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("dflash-train: error: "), err

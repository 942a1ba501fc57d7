"""Reliability of the command line (issue 12, item 7): it parses before importing torch, bounds the number of ranks,
and reports a path it cannot use in one line (src/shardwise_cli/)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import shardwise
import shardwise_cli
from shardwise import demo
from shardwise.demo import DemoOptions
from shardwise.hybrid import DP_STRATEGIES
from shardwise.models.gpt import PRESETS
from shardwise_cli import MAX_RANKS, main, max_ranks

FAST = ["--backend", "thread", "--nproc", "1", "--steps", "1", "--preset", "tiny", "--no-progress"]

# Runs the entry point in a fresh interpreter; prints the exit code and whether torch (or the shardwise package) got
# imported. No time is asserted: on a loaded CI machine even the parser can take a second.
_PROBE = textwrap.dedent("""
    import sys
    from shardwise_cli import main
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
    print(code, "torch" in sys.modules, "shardwise" in sys.modules)
""")


def _probe(argv: list[str]) -> tuple[int, bool, bool, str]:
    result = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    code, torch_loaded, package_loaded = result.stdout.split()[-3:]
    return int(code), torch_loaded == "True", package_loaded == "True", result.stderr


@pytest.mark.parametrize(
    "argv, code, needle",
    [
        (["demo", "--nproc", "0"], 2, "argument --nproc: 0 must be >= 1"),
        (["demo", "--strategy", "nope"], 2, "argument --strategy: invalid choice: 'nope'"),
        (["demo", "--nproc", "100000"], 2, "argument --nproc: 100000 ranks exceeds the limit of"),
        (["demo", "--backend", "thread", "--dp", "300"], 2, "dp x tp x pp = 300 x 1 x 1 = 300 ranks exceeds"),
        (["demo", "--data", "/no/such/corpus.txt"], 2, "argument --data: '/no/such/corpus.txt' does not exist"),
        ([], 2, "the following arguments are required: command"),
        (["demo", "--help"], 0, ""),
        (["--version"], 0, ""),
    ],
)
def test_usage_errors_and_help_do_not_import_torch(argv, code, needle):
    got, torch_loaded, package_loaded, err = _probe(argv)
    assert got == code, err
    assert needle in err
    assert not torch_loaded and not package_loaded  # the parser alone answers


def test_the_console_script_is_the_torch_free_entry_point():
    (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "shardwise"]
    assert script.value == "shardwise_cli:main"
    # `python -m shardwise` runs it too (test_cli.py); the library itself never imports shardwise_cli
    # (tests/test_import_graph.py)
    assert importlib.metadata.version("shardwise") == shardwise.__version__  # what --version prints


def test_the_vocabulary_is_the_librarys():
    # Spelled in shardwise_cli so that the parser needs no torch; these are the values the library accepts.
    assert shardwise_cli.STRATEGIES == DP_STRATEGIES == demo.STRATEGIES
    assert shardwise_cli.PRESETS == tuple(sorted(PRESETS))
    assert demo.SCHEDULES == shardwise_cli.SCHEDULES  # the library spells its own: it never imports the CLI
    options = DemoOptions()
    assert shardwise_cli.DEMO_DEFAULTS == {name: getattr(options, name) for name in shardwise_cli.DEMO_DEFAULTS}
    parsed = shardwise_cli.build_parser().parse_args(["demo"])
    assert {name: getattr(parsed, name) for name in shardwise_cli.DEMO_DEFAULTS} == shardwise_cli.DEMO_DEFAULTS


# ---- the bound on ranks ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--nproc", "100000"], f"argument --nproc: 100000 ranks exceeds the limit of {max_ranks('gloo')} gloo "
                                f"processes (8 per CPU core"),
        (["--backend", "thread", "--nproc", str(MAX_RANKS + 1)],
         f"argument --nproc: {MAX_RANKS + 1} ranks exceeds the limit of {MAX_RANKS} thread ranks"),
        (["--dp", "64", "--tp", "2", "--pp", "4"], "dp x tp x pp = 64 x 2 x 4 = 512 ranks exceeds the limit of 256 "
                                                   "thread ranks"),
    ],
)
def test_too_many_ranks_is_a_usage_error_naming_the_bound(argv, needle, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv, "--out", str(tmp_path)])
    assert info.value.code == 2
    assert f"shardwise demo: error: {needle}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_the_bound_itself_is_allowed(capsys, tmp_path):
    # 256 thread ranks pass the bound and reach DemoOptions, whose own check then refuses tp = 3 (nothing runs).
    with pytest.raises(SystemExit) as info:
        main(["demo", "--backend", "thread", "--nproc", str(MAX_RANKS), "--tp", "3", "--out", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "exceeds the limit" not in err and f"nproc={MAX_RANKS} is not a multiple of tp x pp = 3" in err
    assert 1 <= max_ranks("gloo") <= MAX_RANKS == max_ranks("thread")


# ---- paths it cannot use: one line, exit 1, nothing trained ---------------------------------------------------------
def test_an_existing_file_as_out_is_one_line_without_traceback(tmp_path):
    out = tmp_path / "a-file"
    out.write_text("not a folder\n")
    result = subprocess.run([sys.executable, "-m", "shardwise", "demo", *FAST, "--out", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr == f"shardwise demo: cannot write the run directory under {out}: it exists and is not a " \
                            f"directory\n"
    assert "Traceback" not in result.stdout + result.stderr
    assert out.read_text() == "not a folder\n"


@pytest.fixture
def corpus_file(tmp_path: Path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    return str(path)


def test_an_out_below_a_file_is_one_line(tmp_path, corpus_file, capsys):
    (tmp_path / "f").write_text("x")
    out = tmp_path / "f" / "sub"
    assert main(["demo", *FAST, "--data", corpus_file, "--out", str(out)]) == 1
    assert capsys.readouterr().err == (f"shardwise demo: cannot write the run directory under {out}: Not a directory "
                                       f"({out})\n")


@pytest.mark.parametrize("content, reason", [
    (None, "has no text files"),  # a folder without any
    ("", "ByteCorpus source is empty"),
    ("short", "corpus has 5 bytes, fewer than seq_len + 1 = 33 needed for one window"),
])
def test_a_corpus_it_cannot_train_on_is_one_line(content, reason, tmp_path, capsys):
    data = tmp_path / "data"
    if content is None:
        data.mkdir()
        (data / "image.bin").write_bytes(b"\0" * 100)
    else:
        data.write_text(content)
    out = tmp_path / "runs"
    assert main(["demo", *FAST, "--data", str(data), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"shardwise demo: cannot train on --data {data}: ") and reason in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()  # found before any rank started: no run directory either


def test_a_run_directory_that_fails_after_training_is_one_line(tmp_path, corpus_file, capsys, monkeypatch):
    def refuse(out: Path) -> Path:
        raise PermissionError(13, "Permission denied", str(out / "20260101-000000"))

    monkeypatch.setattr(demo.run, "make_run_dir", refuse)  # e.g. the folder was made read-only during training
    out = tmp_path / "runs"
    assert main(["demo", *FAST, "--data", corpus_file, "--out", str(out)]) == 1
    assert capsys.readouterr().err == (f"shardwise demo: cannot write the run directory under {out}: Permission "
                                       f"denied ({out / '20260101-000000'})\n")

"""What a first run meets outside the engine's numbers: a cut character, a closed pipe, the cost of
`--help`."""

from __future__ import annotations

import io
import subprocess
import sys

import moetide
from moetide.engine.detokenize import REPLACEMENT_CHAR, stable_prefix

CYRILLIC = "Привет, как дела? Расскажи о себе."


def test_a_character_cut_by_max_tokens_is_not_streamed_as_u_fffd(capsys):
    """Cyrillic letters take two byte-level tokens on the demo tokenizer: a `--max-tokens` that ends
    between them leaves a half character. `moetide generate` streams the whole ones only, and the
    API's text is the same."""
    from moetide.cli import main

    llm = moetide.LLM(device="cpu")
    full = llm.chat(
        [{"role": "user", "content": CYRILLIC}],
        moetide.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
    )
    ids = full[0].token_ids
    cuts = [k for k in range(1, len(ids) + 1) if llm.tokenizer.decode(ids[:k]).endswith(REPLACEMENT_CHAR)]
    assert cuts, "no prefix of the answer ends in half a character: the case is not exercised"
    k = cuts[0]
    expected = stable_prefix(llm.tokenizer.decode(ids[:k]))
    cut = llm.chat(
        [{"role": "user", "content": CYRILLIC}],
        moetide.SamplingParams(max_tokens=k, temperature=0, ignore_eos=True),
    )
    assert cut[0].finish_reason == "length" and cut[0].text == expected

    assert main(["generate", "--device", "cpu", "--quiet", "--max-tokens", str(k), CYRILLIC]) == 0
    out = capsys.readouterr().out.rstrip("\n")
    assert REPLACEMENT_CHAR not in out and out == expected, (out, expected)


def test_help_and_argument_errors_do_not_import_torch():
    """`--help` of every command and an argument error answer without importing torch or
    transformers (seconds of start-up)."""
    heavy = ("torch", "transformers", "safetensors", "numpy")
    probe = (
        "import sys\n"
        "from moetide.cli import main\n"
        "for argv in (['--help'], ['generate', '--help'], ['serve', '--help'], ['bench', '--help'],"
        " ['eval', '--help'], ['prepare', '--help'], ['generate'], ['generate', '--max-tokens', 'x', 'hi'],"
        " ['serve', '--port', 'x']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout[-500:]
    assert "error: the following arguments are required: prompt" in proc.stderr


def test_generate_into_a_closed_pipe_exits_quietly():
    """`moetide generate ... | head -c 30`: the reader goes away mid-stream; moetide stops without a
    BrokenPipeError traceback."""
    cmd = [
        sys.executable,
        "-m",
        "moetide.cli",
        "generate",
        "--device",
        "cpu",
        "--quiet",
        "--max-tokens",
        "48",
    ]
    writer = subprocess.Popen([*cmd, "Tell me a long story."], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = writer.stdout.read(1)  # the stream has started
    writer.stdout.close()  # `head` exits
    _, err = writer.communicate(timeout=300)
    assert first
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()[-2000:]
    assert writer.returncode in (0, 1, 141), writer.returncode


def test_the_demo_models_cache_is_not_written_into_the_package(tmp_path, monkeypatch):
    """The embedded demo model is the package's own files: its quantized experts go to
    `$MOETIDE_CACHE` (the tests point it under the temporary directory), while a checkpoint the
    user owns keeps its cache beside it."""
    import tempfile
    from pathlib import Path

    from moetide.engine.llm import demo_model_path
    from moetide.store.prepare import default_cache_dir

    demo = Path(demo_model_path())
    assert not default_cache_dir(demo).resolve().is_relative_to(demo.resolve().parent)
    assert default_cache_dir(demo).is_relative_to(tempfile.gettempdir())  # tests/conftest.py
    monkeypatch.setenv("MOETIDE_CACHE", str(tmp_path / "elsewhere"))
    assert default_cache_dir(demo).parent == tmp_path / "elsewhere"
    assert default_cache_dir(tmp_path) == tmp_path / ".moetide-cache"


# -- progress output: bars on a terminal only ----------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_draws_on_a_terminal_and_not_into_a_file(monkeypatch, capsys):
    from moetide.progress import bar

    assert list(bar(range(3), desc="work", enabled=True)) == [0, 1, 2]
    assert capsys.readouterr().err == ""  # stderr is not a terminal under capsys
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(bar(range(3), desc="work", enabled=True)) == [0, 1, 2]
    assert "\r" in terminal.getvalue() and "work" in terminal.getvalue()


def test_serve_warm_up_writes_one_plain_line_into_a_file(capsys):
    """`moetide serve`'s warm-up with stderr to a log: one line, no carriage-return redraw."""
    llm = moetide.LLM(device="cpu")
    llm.engine.warm_up(progress=True)
    err = capsys.readouterr().err
    assert "[moetide] warmed up:" in err and "\r" not in err, repr(err)


def test_library_progress_bars_are_off_when_stderr_is_a_file(capsys):
    """transformers' and huggingface_hub's bars (a checkpoint's "Loading weights") follow the same
    rule once a command runs; `--help` does not import them to decide."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as hf_logging

    from moetide.cli import main

    hf_logging.enable_progress_bar()
    enable_progress_bars()
    try:
        assert main(["info"]) == 0
        assert not hf_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
    finally:
        hf_logging.enable_progress_bar()
        enable_progress_bars()


def test_progress_decisions_go_through_one_helper():
    """No module but moetide/progress.py asks isatty() or builds a tqdm bar itself (the rule lives
    in one place)."""
    from pathlib import Path

    src = Path(moetide.__file__).parent
    offenders = [
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if p.name != "progress.py" and any(s in p.read_text() for s in (".isatty()", "tqdm("))
    ]
    assert offenders == [], offenders

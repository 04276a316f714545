"""Prepared caches carry a content hash and are checked on load: a damaged one (its bytes, dtype,
shape or layout) is rebuilt from the checkpoint with one line saying so, or refused with one line
when the checkpoint's experts are not there to rebuild it from; writing one leaves no temporary
file on any path. The issue's reproducers run `moetide generate --policy static-int2` on the demo
model; the other damages go through the store on the tiny OLMoE checkpoint."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from test_bad_input import run_cli

from moetide.errors import CheckpointError
from moetide.models.loader import load_weights
from moetide.store.checked_file import DamagedFileError, load_checked, save_checked
from moetide.store.prepare import cache_file, ensure_precision, load_cached

GENERATE = (
    "generate",
    "--device",
    "cpu",
    "--policy",
    "static-int2",
    "--max-tokens",
    "3",
    "--temperature",
    "0",
    "The sea",
)


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    """A cache directory holding the demo model's int2 cache, and the greedy output with it intact."""
    folder = tmp_path_factory.mktemp("demo-cache")
    first = run_cli(*GENERATE, "--cache-dir", str(folder))
    assert first.returncode == 0, first.stderr
    (path,) = folder.glob("int2-*.safetensors")
    return path, first.stdout


def _damage_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "damaged" in line]


def _generate_with(path) -> subprocess.CompletedProcess:
    return run_cli(*GENERATE, "--cache-dir", str(path.parent))


def test_a_flipped_mebibyte_is_caught_and_the_cache_rebuilt(demo_cache):
    """The issue's reproducer 3: 1 MiB of an int2 cache's data flipped loaded silently."""
    path, intact = demo_cache
    data = np.fromfile(path, dtype=np.uint8)
    data[len(data) // 2 : len(data) // 2 + (1 << 20)] ^= 0xFF
    data.tofile(path)
    proc = _generate_with(path)
    assert proc.returncode == 0, proc.stderr
    (line,) = _damage_lines(proc.stderr)
    assert str(path) in line and "content hash" in line and "rebuilding it from the checkpoint" in line
    assert proc.stdout == intact
    load_checked(path)  # written again, intact
    assert _damage_lines(_generate_with(path).stderr) == []


def test_an_arena_of_the_wrong_dtype_is_rebuilt_not_a_traceback(demo_cache):
    """The issue's reproducer 5: a float16 arena (with a valid hash) crashed with a ValueError."""
    path, intact = demo_cache
    tensors, record = load_checked(path)
    save_checked({"arena": tensors["arena"].view(torch.float16)}, path, record)
    proc = _generate_with(path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = _damage_lines(proc.stderr)
    assert "float16" in line and "uint8" in line
    assert proc.stdout == intact


def test_a_cache_path_that_cannot_be_replaced_leaves_no_temporary_file(demo_cache, tmp_path):
    """The issue's leftover: a 7 MB `*.safetensors.<pid>.tmp` per run when the rename failed."""
    path, intact = demo_cache
    folder = tmp_path / "cache"
    blocked = folder / path.name
    blocked.mkdir(parents=True)  # a directory where the cache file goes: the rename fails
    proc = run_cli(*GENERATE, "--cache-dir", str(folder))
    assert proc.returncode == 0 and proc.stdout == intact, proc.stderr
    assert sorted(p.name for p in folder.iterdir()) == [path.name]


def test_a_write_that_fails_midway_leaves_no_temporary_file(tmp_path):
    """A full disk, as a file size limit: the writer fails inside the file; the caller gets OSError."""
    script = f"""
        import resource, signal, torch
        from pathlib import Path
        from moetide.store.checked_file import save_checked
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            arena = torch.zeros(1 << 20, dtype=torch.uint8)
            save_checked({{"arena": arena}}, Path({str(tmp_path)!r}) / "c.safetensors")
        except OSError as e:
            print("OSError", e)
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, check=False
    )
    assert proc.stdout.startswith("OSError"), proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []


# -- through the store, on the tiny checkpoint ---------------------------------------------------------------
@pytest.fixture(scope="module")
def olmoe(tiny_checkpoints):
    return tiny_checkpoints["olmoe"][0]


def _fresh_store(checkpoint):
    return load_weights(str(checkpoint), device="cpu", dtype="float32", progress=False).store


def _damaged(path, how: str) -> None:
    data = np.fromfile(path, dtype=np.uint8)
    header = 8 + int(data[:8].view(np.uint64)[0])
    if how == "zeroed":
        data[header:] = 0
    elif how == "flipped":
        data[header:] ^= 0xFF
    elif how == "one bit":
        data[-1] ^= 1
    elif how == "truncated":
        data = data[: len(data) - 100]
    elif how == "header garbage":
        data[8:header] = ord(" ")
    data.tofile(path)


@pytest.mark.parametrize("how", ["zeroed", "flipped", "one bit", "truncated", "header garbage"])
def test_every_damage_is_rebuilt_to_the_same_bytes(olmoe, tmp_path, how, capsys):
    store = _fresh_store(olmoe)
    path = ensure_precision(store, olmoe, "int2", cache_dir=tmp_path, progress=False)
    original = store.versions["int2"].clone()
    _damaged(path, how)
    with pytest.raises(DamagedFileError):
        load_checked(path)
    again = _fresh_store(olmoe)
    assert ensure_precision(again, olmoe, "int2", cache_dir=tmp_path, progress=False) == path
    assert torch.equal(again.versions["int2"], original)
    lines = _damage_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "rebuilding" in lines[0], lines
    load_checked(path)


def test_a_cache_without_a_hash_or_of_another_layout_is_rebuilt(olmoe, tmp_path, capsys):
    from safetensors.torch import save_file

    store = _fresh_store(olmoe)
    path = ensure_precision(store, olmoe, "int2", cache_dir=tmp_path, progress=False)
    tensors, record = load_checked(path)
    unhashed = {k: v for k, v in record.items() if not k.startswith("sha256")}
    save_file(tensors, str(path), metadata=unhashed)  # what an older moetide wrote
    assert not load_cached(_fresh_store(olmoe), path, "int2")
    assert "no content hash" in capsys.readouterr().err
    save_checked({"arena": tensors["arena"][:-1]}, path, record)  # one expert short
    assert not load_cached(_fresh_store(olmoe), path, "int2")
    assert "this model needs uint8" in capsys.readouterr().err
    save_checked(tensors, path, {**record, "nbytes": "12"})
    assert not load_cached(_fresh_store(olmoe), path, "int2")
    assert "layout record" in capsys.readouterr().err


def test_a_damaged_cache_without_the_experts_to_rebuild_it_is_refused_in_one_line(olmoe, tmp_path):
    store = _fresh_store(olmoe)
    path = ensure_precision(store, olmoe, "int2", cache_dir=tmp_path, progress=False)
    assert path == cache_file(olmoe, "int2", store.values_dtype, tmp_path)
    _damaged(path, "flipped")
    bare = _fresh_store(olmoe)
    bare.drop_precision("hi")  # the checkpoint's experts are not in memory
    with pytest.raises(CheckpointError, match="damaged .* not loaded to rebuild it") as info:
        load_cached(bare, path, "int2")
    assert "\n" not in str(info.value)
    assert "int2" not in bare.versions  # the damaged bytes were not kept

"""The extension loader's build folder and lock (nn/native.py); no compiler needed."""

import multiprocessing
import os
import time

from torchformer.nn import native


def test_build_folder_is_keyed_by_source_flags_and_environment(tmp_path, monkeypatch):
    a = native.build_folder(tmp_path)
    assert a.is_dir() and a.parent == tmp_path and a.name.startswith(native.NAME + "-")
    assert native.build_folder(tmp_path) == a  # stable: the next process finds the same build
    monkeypatch.setattr(native, "FLAGS", [*native.FLAGS, "-DOTHER"])
    assert native.build_folder(tmp_path) != a  # other flags: another folder, no rebuild ping-pong


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path):
    (tmp_path / "lock").touch()  # fresh: the age rule alone would wait on it
    with native.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def hold_then_die(folder, ready):
    with native.build_lock(folder):
        (folder / "lock").touch()  # as torch's loader does mid-build
        ready.set()
        time.sleep(60)


def test_the_os_lock_serialises_loaders_and_dies_with_its_process(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=hold_then_die, args=(tmp_path, ready))
    proc.start()
    try:
        assert ready.wait(60)
        os.kill(proc.pid, 9)  # killed mid-build: its torch lock stays, its OS lock goes
        proc.join(30)
        assert (tmp_path / "lock").exists()
        t0 = time.monotonic()
        with native.build_lock(tmp_path):
            assert not (tmp_path / "lock").exists()
        assert time.monotonic() - t0 < 30
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)

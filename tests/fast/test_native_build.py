"""The extension loader's build folder and lock (fast/native.py); no compiler needed."""

import multiprocessing
import os
import time

from torchformer.fast import native


def test_build_folder_is_keyed_by_source_flags_and_environment(tmp_path, monkeypatch):
    a = native.build_folder(tmp_path)
    assert a.is_dir() and a.parent == tmp_path and a.name.startswith(native.NAME + "-")
    assert native.build_folder(tmp_path) == a  # stable: the next process finds the same build
    monkeypatch.setattr(native, "FLAGS", {isa: [*f, "-DOTHER"] for isa, f in native.FLAGS.items()})
    assert native.build_folder(tmp_path) != a  # other flags: another folder, no rebuild ping-pong
    monkeypatch.undo()
    # the other instruction set's build (an image moved to another CPU) never reuses this one's
    other = "avx2" if native.isa() == "avx512" else "avx512"
    monkeypatch.setattr(native, "isa", lambda: other)
    assert native.build_folder(tmp_path) != a


def test_another_checkout_gets_its_own_build_folder(tmp_path, monkeypatch):
    """The same sources at another path (a second clone): ninja's build file names sources by path,
    so a shared folder would be rebuilt for each checkout in turn."""
    a = native.build_folder(tmp_path)
    clone = tmp_path / "clone"
    clone.mkdir()
    copies = []
    for source in native.SOURCES:
        copy = clone / source.name
        copy.write_bytes(source.read_bytes())
        copies.append(copy)
    monkeypatch.setattr(native, "SOURCES", copies)
    assert native.build_folder(tmp_path) != a


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


def test_the_build_honours_torch_extensions_dir_runs_one_ninja_and_says_so(tmp_path, monkeypatch, caplog):
    """TORCH_EXTENSIONS_DIR is the build root; the ninja package's binary leads PATH during the build
    (two ninja versions in one folder rebuilt each other's output); a first build is announced."""
    import ninja
    import torch.utils.cpp_extension as ext

    seen = {}

    def fake_load(name, sources, extra_cflags, build_directory):
        seen.update(folder=build_directory, path=os.environ["PATH"])
        raise RuntimeError("stop here")  # the loader then falls back, as without a compiler

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("TORCHFORMER_NATIVE", "1")
    monkeypatch.setattr(ext, "load", fake_load)
    monkeypatch.setattr(native.torch.cpu, "_is_avx512_supported", lambda: True)
    with caplog.at_level("WARNING", logger=native.__name__):
        assert native.kernels.__wrapped__() is None
    assert seen["folder"] == str(native.build_folder(tmp_path))
    assert seen["path"].split(os.pathsep)[0] == ninja.BIN_DIR
    assert os.environ["PATH"] == "/usr/bin:/bin"  # restored
    messages = [r.getMessage() for r in caplog.records]
    assert any("building the CPU kernels once" in m for m in messages)
    assert any("could not be built (stop here)" in m for m in messages)


def test_kernels_command_reports_builds_ahead_and_fails_clearly(tmp_path, monkeypatch, capsys):
    from torchformer.cli.main import main
    from torchformer.fast import compiled

    warmed = []
    monkeypatch.setattr(compiled, "warm_inductor", lambda: warmed.append(1) or 12.0)  # each build; not status
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHFORMER_NATIVE", "1")
    monkeypatch.setattr(native.torch.cpu, "_is_avx512_supported", lambda: True)
    folder = native.build_folder(tmp_path)
    assert main(["kernels", "status"]) == 0
    assert f"not built yet (torchformer kernels build): {folder}" in capsys.readouterr().out
    monkeypatch.setattr(native, "kernels", lambda: None)  # as when the compiler fails
    assert main(["kernels", "build"]) == 2
    assert f"could not be built in {folder}" in capsys.readouterr().err
    assert not warmed  # a failed build stops before inductor
    monkeypatch.setattr(native, "kernels", lambda: (folder / f"{native.NAME}.so").touch() or object())
    assert main(["kernels", "build"]) == 0
    out = capsys.readouterr().out
    assert "the CPU kernels are ready for avx512 (built in" in out and warmed == [1]
    assert "inductor's one-time work on this machine is done (12 s)" in out
    assert main(["kernels", "status"]) == 0
    assert f"the CPU kernels are built: {folder}" in capsys.readouterr().out
    monkeypatch.setenv("TORCHFORMER_NATIVE", "0")
    assert main(["kernels", "build"]) == 0
    assert "turned off (TORCHFORMER_NATIVE=0)" in capsys.readouterr().out
    monkeypatch.setenv("TORCHFORMER_NATIVE", "1")
    monkeypatch.setattr(native.torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(native.torch.cpu, "_is_avx2_supported", lambda: False)
    assert main(["kernels", "build"]) == 0
    assert "neither AVX-512 nor AVX2 with FMA and F16C: the library paths run" in capsys.readouterr().out
    assert warmed == [1, 1, 1]  # without the kernels too: inductor's work is the same


def test_warming_inductor_compiles_a_step_with_each_host_code(monkeypatch):
    from torchformer.fast import compiled

    kinds = []

    def compile_step(fn, cpp):
        kinds.append(cpp)
        return fn  # eager: what is checked is what is asked for, and that it runs

    monkeypatch.setattr(compiled, "compile_step", compile_step)
    assert compiled.warm_inductor() >= 0 and kinds == [True, False]


def test_a_finished_build_is_imported_again_without_torchs_loader(monkeypatch):
    """Once a build and import succeeded its folder holds a stamp of the library, and the next
    process imports the library directly (no setuptools, no ninja run); a stamp that does not
    match the library (relinked since, or a build that died) sends it back to torch's loader."""
    import torch.utils.cpp_extension as ext

    from tests.fast.built import built_kernels

    built_kernels()
    folder = native.build_folder(native.build_root())
    assert (folder / native.STAMP).read_text() == native.signature(folder / f"{native.NAME}.so")

    def no_loader(*args, **kwargs):
        raise AssertionError("torch's loader ran for a finished build")

    monkeypatch.setattr(ext, "load", no_loader)
    module = native.built(folder)
    assert module is not None and callable(module.decode_attention)
    monkeypatch.setattr(native, "signature", lambda library: "another library")
    assert native.built(folder) is None
    assert native.built(folder.with_name(folder.name + "-never-built")) is None

"""The native kernels compiled ahead (`llm/kernel_builds.py`): each family neither loaded in this
process nor built in the cache starts compiling in a process of its own, side by side, and `wait`
returns once all have ended; families already built or loaded start nothing."""

import sys
import time
import types
from functools import cache

from draftwise import native
from draftwise.llm import kernel_builds


def fake_family(tmp_path, monkeypatch, name: str, seconds: float):
    """A module whose cached getter 'compiles' for `seconds`, then leaves a file behind."""
    module = types.ModuleType(name)

    @cache
    def build():
        return None

    module.build = build
    monkeypatch.setitem(sys.modules, name, module)
    code = f"import time, pathlib; time.sleep({seconds}); pathlib.Path({str(tmp_path / name)!r}).touch()"
    return module, code


def test_missing_families_compile_side_by_side_and_wait_ends_with_them(tmp_path, monkeypatch, capsys):
    commands = []
    for name in ("fake_family_a", "fake_family_b"):
        _, code = fake_family(tmp_path, monkeypatch, name, 1.0)
        commands.append(code)
    monkeypatch.setattr(kernel_builds, "FAMILIES", {"a": ("fake_family_a", "build", ()),
                                                    "b": ("fake_family_b", "build", ())})
    monkeypatch.setattr(native, "needs_compiling", lambda family, builds: True)
    codes = iter(commands)
    monkeypatch.setattr(kernel_builds, "compile_command", lambda module_name, getter: next(codes))
    started = time.monotonic()
    builds = kernel_builds.start_kernel_builds("cpu")
    assert builds.families == ["a", "b"] and len(builds.processes) == 2
    assert not (tmp_path / "fake_family_a").exists()  # started, not waited for
    builds.wait()
    elapsed = time.monotonic() - started
    assert (tmp_path / "fake_family_a").exists() and (tmp_path / "fake_family_b").exists()
    assert elapsed < 1.9, f"the two ran one after the other ({elapsed:.1f} s)"
    err = capsys.readouterr().err
    assert "compiling draftwise's native kernels for this CPU (a, b;" in err and "native kernels compiled in" in err


def test_built_loaded_or_gpu_families_start_nothing(tmp_path, monkeypatch):
    module, _ = fake_family(tmp_path, monkeypatch, "fake_family_c", 0)
    monkeypatch.setattr(kernel_builds, "FAMILIES", {"c": ("fake_family_c", "build", ())})
    monkeypatch.setattr(native, "needs_compiling", lambda family, builds: False)  # in the cache
    assert kernel_builds.start_kernel_builds("cpu").processes == []
    monkeypatch.setattr(native, "needs_compiling", lambda family, builds: True)
    assert kernel_builds.start_kernel_builds("cuda").processes == []  # no CPU kernels on a GPU
    module.build()  # loaded in this process
    assert kernel_builds.start_kernel_builds("cpu").processes == []


def test_a_family_is_in_the_cache_once_its_extension_is(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))
    from draftwise.model import native_layer_ops

    builds = native_layer_ops.BUILDS
    if native.unavailable_reason(builds) is not None:
        assert not native.needs_compiling("layer_ops", builds)
        return
    assert native.needs_compiling("layer_ops", builds)
    which = native.chosen(builds)
    folder = native.build_folder("layer_ops", which)
    folder.mkdir(parents=True)
    (folder / f"draftwise_layer_ops_{which.isa}_{which.digest()}.so").touch()
    assert not native.needs_compiling("layer_ops", builds)


def test_a_family_that_fails_to_compile_is_named(tmp_path, monkeypatch, capsys):
    fake_family(tmp_path, monkeypatch, "fake_family_d", 0)
    monkeypatch.setattr(kernel_builds, "FAMILIES", {"d": ("fake_family_d", "build", ())})
    monkeypatch.setattr(native, "needs_compiling", lambda family, builds: True)
    monkeypatch.setattr(kernel_builds, "compile_command", lambda module_name, getter: "raise SystemExit(1)")
    kernel_builds.start_kernel_builds("cpu").wait()
    assert "(d failed: tried again at first use)" in capsys.readouterr().err


def test_a_build_left_unfinished_by_a_killed_process_does_not_hang_the_next_start(tmp_path):
    """PyTorch's builder waits for ever on the `lock` file a builder killed mid-compile leaves; the
    next process to load the family removes it (it holds the builder lock, so the file is stale) and
    loads the build. (In a copy of this machine's built attention kernels, so nothing compiles.)"""
    import shutil
    import subprocess

    import pytest

    from draftwise.cache.attention_backend import BUILDS

    which = native.chosen(BUILDS)
    if which is None or native.needs_compiling("attention", BUILDS):
        native.build("attention", BUILDS)
    if which is None or native.needs_compiling("attention", BUILDS):
        pytest.skip("no native attention build on this machine")
    built = native.build_folder("attention", which)
    copy = tmp_path / "kernels" / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "builder.lock"))
    (copy / "lock").touch()  # what a build killed mid-compile leaves
    code = ("from draftwise import native; from draftwise.cache.attention_backend import BUILDS; "
            "print('loaded' if native.compile_build('attention', native.chosen(BUILDS)) is not None else 'none')")
    env = {**__import__("os").environ, "DRAFTWISE_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert result.stdout.strip().endswith("loaded"), result.stdout[-2000:] + result.stderr[-2000:]
    assert not (copy / "lock").exists()


def test_a_build_is_kept_per_python_as_per_pytorch():
    """An extension built for one Python does not import in another: two environments sharing the
    cache each build their own rather than lose the kernels to a failed import."""
    from draftwise.cache.attention_backend import BUILDS

    which = BUILDS[0]
    name = native.build_folder("attention", which).name
    assert name.endswith(f"-py{sys.version_info.major}{sys.version_info.minor}") and "-torch" in name

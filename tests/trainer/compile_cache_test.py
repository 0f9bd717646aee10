"""The persistent compilation cache: on in a directory, off on request, never fatal."""

import subprocess
import sys
import textwrap

import jax
import pytest

from m2po_jax.trainer import compile_cache


@pytest.fixture(autouse=True)
def _restore_jax_config():
    before = (
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_persistent_cache_min_compile_time_secs,
    )
    yield
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def test_default_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "cc"))
    assert compile_cache.default_dir() == str(tmp_path / "cc")
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == str(tmp_path / "xdg" / "m2po_jax" / "xla")


def test_off_leaves_the_cache_unset(tmp_path):
    jax.config.update("jax_compilation_cache_dir", None)
    for value in ("off", "", "none"):
        assert compile_cache.enable(value) is None
    assert jax.config.jax_compilation_cache_dir is None


def test_an_unusable_directory_is_skipped(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    jax.config.update("jax_compilation_cache_dir", None)
    assert compile_cache.enable(str(blocker / "cache")) is None
    assert jax.config.jax_compilation_cache_dir is None


def test_a_second_process_loads_instead_of_compiling(tmp_path):
    # Two fresh processes compile the same program; the second finds it in the cache.
    script = textwrap.dedent(
        f"""
        import jax, jax.numpy as jnp
        from m2po_jax import compile_cache
        compile_cache.MIN_COMPILE_SECONDS = 0.0
        compile_cache.enable({str(tmp_path / "cc")!r})
        hits = []
        jax.monitoring.register_event_listener(
            lambda name, **kw: hits.append(name) if "cache_hits" in name else None
        )
        f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
        print(float(f(jnp.ones((32, 32)))), len(hits))
        """
    )
    runs = [
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    first, second = (r.stdout.split() for r in runs)
    assert first[0] == second[0]
    assert int(first[1]) == 0 and int(second[1]) >= 1
    assert any((tmp_path / "cc").iterdir())

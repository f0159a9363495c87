"""`kernels.platform.LateCompileLog`: the hooks as Triton calls them (keyword arguments of
`JITFunction._call_hook`), and what the warning says about the variant."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from kernels.platform import LateCompileLog, stop_watching_late_compiles, watch_late_compiles


def _hook_kwargs(key: str) -> dict:
    compile = {
        "key": key,
        "signature": {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr", "DTYPE": "constexpr"},
        "constants": {(2,): 64, (3,): "<triton dtype fp32>"},
        "configs": [{(0,): [["tt.divisibility", 16]]}],
    }
    return dict(
        key=key,
        repr="kernel[...]",
        fn=SimpleNamespace(name="_some_kernel"),
        compile=compile,
        is_manual_warmup=False,
        already_compiled=False,
    )


def test_each_compile_is_counted_and_named(caplog):
    log = LateCompileLog()
    with caplog.at_level(logging.WARNING, logger="kernels.platform"):
        for key in ("a", "b"):
            assert log.before(**_hook_kwargs(key)) is False  # False: Triton goes on compiling
            log.after(**_hook_kwargs(key))
    assert log.count == 2
    assert log.seconds >= 0.0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "_some_kernel" in messages[0]
    # Constexpr values by parameter name; dtype-like constants (not per variant) left out.
    assert "{'BLOCK': 64}" in messages[0]
    assert "tt.divisibility" in messages[0]


def test_nothing_to_watch_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.settings import reload_settings

    reload_settings()
    try:
        assert watch_late_compiles() is None
    finally:
        monkeypatch.undo()
        reload_settings()


def test_a_warm_up_stops_only_our_watch():
    """`stop_watching_late_compiles` (what a warm-up calls first) removes a LateCompileLog's
    hooks, so another engine's watch in the process does not count this warm-up's compiles;
    a hook of someone else's stays."""
    from triton import knobs

    runtime = knobs.runtime
    saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    log = LateCompileLog()

    def foreign(**_):
        return None

    try:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = log.before, foreign
        stop_watching_late_compiles()
        assert runtime.jit_cache_hook is None
        assert runtime.jit_post_compile_hook is foreign
        runtime.jit_post_compile_hook = log.after
        stop_watching_late_compiles()
        assert runtime.jit_post_compile_hook is None
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved

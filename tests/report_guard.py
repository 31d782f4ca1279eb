"""A pytest plugin (loaded by tests/conftest.py) that keeps one failing test from ending the
whole run.

CPython 3.11.7's ast.parse keeps its recursion counter in interpreter-wide state. pytest
parses a failing test's source while it writes the failure report; if a garbage collection
runs then, and a finalizer formats a traceback (Python 3.11's traceback module parses the
failing line to place its carets; celery's AsyncResult.__del__ does this when its Redis is
gone), the nested parse resets the counter and the outer one raises "SystemError: AST
constructor recursion depth mismatch". pytest reports that as INTERNALERROR and stops: every
later test goes unrun. The garbage collector is off while a report is made; whatever it would
have collected is collected right after. It is off too while the session ends (sessionfinish and
the terminal summary, outermost): plugins import modules there (hypothesis' and schemathesis'
do), and pytest's assertion rewriting parses each one it imports, so the same collection during
that parse ended the run with the same error after every test had run."""

from __future__ import annotations

import gc

import pytest


def _without_gc():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield from _without_gc()


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    yield from _without_gc()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    yield from _without_gc()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    yield from _without_gc()

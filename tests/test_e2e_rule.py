"""The e2e rule (tests/e2e_rule.py) on planted tests, run by a pytest of their own in a fresh process: a test
that starts an interpreter without the `e2e` mark fails, and the failure says what it started and how to mark
it; a marked one passes, and so do one that starts nothing, one that runs a program that is no interpreter and
one that only wakes a once-per-process helper,
or whose compiler wrapper (a `#!` script) Triton's launcher build starts. A command of the tests' command server
(tests/cli_forks.py) counts in every test that starts one, not only in the first, which starts the server."""

from __future__ import annotations

import pytest

from tests.run_helpers import ROOT

pytestmark = pytest.mark.e2e  # it starts a pytest, which starts more

PLANTED = '''
import multiprocessing
import os
import subprocess
import sys
import threading

import pytest


@pytest.fixture(scope="module")
def started_once():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.e2e
def test_marked_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_in_process():
    assert sum([1, 2]) == 3


def test_not_an_interpreter():
    subprocess.run(["true"], check=True)


def test_a_toolchain_wrapper_started_by_triton(tmp_path):
    wrapper = tmp_path / "gcc"  # a compiler wrapper as some images ship it: a script with a #! line
    wrapper.write_text("#!/bin/sh\\nexit 0\\n")
    wrapper.chmod(0o755)
    build = {"__name__": "triton.runtime.build", "subprocess": subprocess}  # Triton's launcher build
    exec("def compile(cc):\\n    subprocess.run([cc, '-O3'], check=True)", build)
    build["compile"](str(wrapper))


def test_a_lock_wakes_only_the_resource_tracker():
    multiprocessing.get_context("spawn").Lock()


def test_unmarked_spawned_process_from_a_thread():
    def start():
        process = multiprocessing.get_context("spawn").Process(target=os.getpid, name="planted")
        process.start()
        process.join()
    thread = threading.Thread(target=start, name="starter")
    thread.start()
    thread.join()


def test_unmarked_fork():
    process = multiprocessing.get_context("fork").Process(target=os.getpid, name="forked")
    process.start()
    process.join()


def test_first_user_of_a_module_fixture(started_once):
    pass


def test_second_user_of_a_module_fixture(started_once):
    pass


@pytest.mark.e2e
def test_marked_command_starts_the_command_server():
    from tests.cli_forks import run
    assert run(["--help"]).returncode == 0


def test_unmarked_command_on_the_running_command_server():
    from tests.cli_forks import run
    assert run(["--help"]).returncode == 0
'''


def test_an_unmarked_test_that_starts_an_interpreter_fails_and_says_how_to_mark_it(pytester, monkeypatch):
    pytester.makepyfile(test_planted=PLANTED)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = pytester.runpytest_subprocess("-p", "tests.e2e_rule", "--strict-markers", "-p", "no:cacheprovider",
                                           "-rfEp")
    result.assert_outcomes(passed=7, failed=4, errors=1)
    summary = [line for line in result.outlines if line.startswith(("PASSED", "FAILED", "ERROR"))]
    assert sorted(line.split(" ")[0] + " " + line.split(" ")[1].split("::")[1] for line in summary) == [
        "ERROR test_first_user_of_a_module_fixture",
        "FAILED test_unmarked_command_on_the_running_command_server",
        "FAILED test_unmarked_fork",
        "FAILED test_unmarked_spawned_process_from_a_thread",
        "FAILED test_unmarked_subprocess",
        "PASSED test_a_lock_wakes_only_the_resource_tracker",
        "PASSED test_a_toolchain_wrapper_started_by_triton",
        "PASSED test_in_process",
        "PASSED test_marked_command_starts_the_command_server",
        "PASSED test_marked_subprocess",
        "PASSED test_not_an_interpreter",
        "PASSED test_second_user_of_a_module_fixture",
    ], summary
    result.stdout.fnmatch_lines([
        "*test_unmarked_subprocess started another interpreter during its call but is not marked e2e:",
        "*-c pass`",
        "*`@pytest.mark.e2e` on the test, or `pytestmark = pytest.mark.e2e` at the top of its module*",
    ])
    result.stdout.fnmatch_lines(["*a SpawnProcess (multiprocessing) named 'planted' running getpid "
                                 "(from thread 'starter')"])
    result.stdout.fnmatch_lines(["*a ForkProcess (multiprocessing) named 'forked' running getpid"])
    result.stdout.fnmatch_lines(["*`asyncrl --help` (a fork of tests/cli_forks.py's command server)"])
    result.stdout.fnmatch_lines(["*test_first_user_of_a_module_fixture started another interpreter during "
                                 "its setup*"])

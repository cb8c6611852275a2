"""Per-tier time budgets and the durations report (tests/budgets.py), run by an in-process pytest on made-up
test modules. Tier budgets are passed in tiny (hundredths of a second), so nothing sleeps long."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent


def _budgets() -> ModuleType:
    """tests/budgets.py, as tests/conftest.py loaded it (or by path, the same way)."""
    name = "hkvd_test_budgets"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE.parent / "budgets.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


budgets = _budgets()

HEAD = "import time\n\nimport pytest\n\n\n"
SLOW = "def test_slow():\n    time.sleep(0.05)\n\n\n"
QUICK = "def test_quick():\n    pass\n\n\n"
TINY = {"fast": 0.01, "vllm": 0.01, "default": 0.01}
ROOMY = {"fast": 10.0, "vllm": 10.0, "default": 10.0}
# The made-up modules run without this checkout's plugins: less to load per run.
ARGS = ("-p", "no:cacheprovider", "-p", "no:asyncio", "-p", "no:anyio", "-p", "no:timeout", "-p", "no:hypothesispytest")


@pytest.fixture
def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for var in (budgets.ENFORCE_ENV, budgets.SCALE_ENV):
        monkeypatch.delenv(var, raising=False)
    pytester.makeini("[pytest]\nmarkers =\n    fast: in-process\n    vllm: real vLLM\n")

    def run(*args: str, tiers: dict[str, float] = TINY,
            exceptions: dict[str, tuple[float, str]] | None = None) -> pytest.RunResult:
        plugin = budgets.BudgetPlugin(pytester.path, tiers=tiers, exceptions=exceptions or {})
        return pytester.runpytest_inprocess(*ARGS, *args, plugins=[plugin])
    return run


def test_a_passing_test_over_its_tier_budget_fails_naming_the_budget_and_the_way_out(
        pytester: pytest.Pytester, run) -> None:  # type: ignore[no-untyped-def]
    pytester.makepyfile(test_a=HEAD + "@pytest.mark.fast\n" + SLOW)
    result = run()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*test_a.py::test_slow took * s, over the fast tier's budget of 0.01 s (setup * s, call * s, "
        "teardown * s): make it faster, share the engine/daemon fixture, or list it with its reason in "
        "tests/budgets.py EXCEPTIONS*"])


def test_the_tiers_follow_the_markers_vllm_first(pytester: pytest.Pytester, run) -> None:  # type: ignore[no-untyped-def]
    pytester.makepyfile(test_a=HEAD + "@pytest.mark.vllm\n@pytest.mark.fast\n" + SLOW + "def test_plain():\n    pass\n")
    result = run(tiers={"fast": 0.01, "vllm": 10.0, "default": 10.0})
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["* s / 10 s    vllm    test_a.py::test_slow",
                                 "* s / 10 s    default test_a.py::test_plain"])


def test_a_failed_or_skipped_test_is_not_failed_again_for_its_time(
        pytester: pytest.Pytester, run) -> None:  # type: ignore[no-untyped-def]
    pytester.makepyfile(test_a=HEAD + SLOW.replace("time.sleep(0.05)", "time.sleep(0.05)\n    assert False")
                        + "@pytest.mark.xfail(strict=True)\ndef test_x():\n    time.sleep(0.05)\n    assert False\n")
    result = run()
    result.assert_outcomes(failed=1, xfailed=1)
    result.stdout.no_fnmatch_line("*over the*budget*")


def test_an_exception_sets_the_budget_of_a_test_or_a_module(
        pytester: pytest.Pytester, run) -> None:  # type: ignore[no-untyped-def]
    pytester.makepyfile(test_a=HEAD + SLOW, test_b=HEAD + SLOW + "def test_other():\n    pass\n")
    exceptions = {"test_a.py::test_slow": (5.0, "sleeps on purpose"), "test_b.py": (5.0, "a slow module"),
                  "test_gone.py": (5.0, "no longer here")}
    result = run(exceptions=exceptions)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines([
        "exceptions (tests/budgets.py EXCEPTIONS): 3 listed, 2 ran",
        "* s / 5 s     test_a.py::test_slow: sleeps on purpose",
        "* s / 5 s     test_b.py (2 tests, slowest): a slow module"])
    # Over a listed budget, the message names the entry and its reason.
    result = run(exceptions={"test_a.py::test_slow": (0.01, "sleeps on purpose")}, tiers=ROOMY)
    result.assert_outcomes(passed=3, errors=1)
    assert ("over its budget of 0.01 s listed in tests/budgets.py EXCEPTIONS['test_a.py::test_slow'] (setup "
            in result.stdout.str())
    result.stdout.fnmatch_lines(["*; listed because: sleeps on purpose): make it faster, or raise the listed budget*"])


def test_keys_from_the_most_to_the_least_specific() -> None:
    assert budgets.candidate_keys("tests/e/test_x.py::TestZ::test_y[a-b]") == [
        "tests/e/test_x.py::TestZ::test_y[a-b]", "tests/e/test_x.py::TestZ::test_y", "tests/e/test_x.py::TestZ::",
        "tests/e/test_x.py::", "tests/e/test_x.py"]
    listed = {"tests/e/test_x.py": (20.0, "module"), "tests/e/test_x.py::TestZ::test_y": (30.0, "family")}
    assert budgets.find_entry("tests/e/test_x.py::TestZ::test_y[a-b]", listed) == "tests/e/test_x.py::TestZ::test_y"
    assert budgets.find_entry("tests/e/test_x.py::test_w", listed) == "tests/e/test_x.py"
    assert budgets.find_entry("tests/e/test_v.py::test_w", listed) is None


@pytest.mark.parametrize(("entry", "error"), [
    ((5.0, ""), "the reason is empty"),
    ((5.0, "  "), "the reason is empty"),
    ((0, "why"), "a number of seconds > 0"),
    ((5.0,), "the value is (seconds, reason)"),
])
def test_a_malformed_exception_is_a_usage_error(entry: tuple, error: str) -> None:
    with pytest.raises(pytest.UsageError, match=r"tests/budgets.py EXCEPTIONS\['tests/x.py'\]") as raised:
        budgets.check_exceptions({"tests/x.py": entry})
    assert error in str(raised.value)
    with pytest.raises(pytest.UsageError, match="a key is a node id"):
        budgets.check_exceptions({"test_x": (5.0, "why")})


def test_an_empty_reason_stops_the_run(pytester: pytest.Pytester, run) -> None:  # type: ignore[no-untyped-def]
    pytester.makepyfile(test_a=QUICK)
    result = run(exceptions={"test_a.py::test_quick": (5.0, "")})
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "ERROR: tests/budgets.py EXCEPTIONS['test_a.py::test_quick']: the reason is empty" in result.stderr.str()


def test_budgets_off_reports_without_failing(pytester: pytest.Pytester, run,  # type: ignore[no-untyped-def]
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_a=HEAD + SLOW + QUICK)
    monkeypatch.setenv(budgets.ENFORCE_ENV, "off")
    result = run()
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*; not enforced (HKVD_TEST_BUDGETS=off)",
                                 "*test_a.py::test_slow  OVER",
                                 "over budget: * (not failed, HKVD_TEST_BUDGETS=off)"])


def test_the_scale_multiplies_every_budget(pytester: pytest.Pytester, run,  # type: ignore[no-untyped-def]
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_a=HEAD + SLOW)
    monkeypatch.setenv(budgets.SCALE_ENV, "1000")
    assert run().ret == pytest.ExitCode.OK
    monkeypatch.setenv(budgets.SCALE_ENV, "0.5")
    run(tiers={"fast": 0.06, "vllm": 0.06, "default": 0.06}).stdout.fnmatch_lines(
        ["*over the default tier's budget of 0.06 s x 0.5 (HKVD_TEST_BUDGET_SCALE)*"])


@pytest.mark.parametrize(("var", "value"), [("HKVD_TEST_BUDGET_SCALE", "fast"), ("HKVD_TEST_BUDGET_SCALE", "0"),
                                            ("HKVD_TEST_BUDGET_SCALE", "-1"), ("HKVD_TEST_BUDGET_SCALE", "inf"),
                                            ("HKVD_TEST_BUDGETS", "no")])
def test_a_bad_environment_value_is_a_usage_error(pytester: pytest.Pytester, run,  # type: ignore[no-untyped-def]
                                                  monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    pytester.makepyfile(test_a=QUICK)
    monkeypatch.setenv(var, value)
    result = run()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {var} * got {value!r}*"])


def test_the_report_totals_each_directory_and_lists_the_slowest(
        pytester: pytest.Pytester, run) -> None:  # type: ignore[no-untyped-def]
    for folder, text in (("unit", QUICK + "def test_two():\n    pass\n"), ("e2e", HEAD + SLOW)):
        (pytester.path / folder).mkdir()
        (pytester.path / folder / f"test_{folder}.py").write_text(text)
    result = run(tiers=ROOMY)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([
        "*= test budgets and durations =*",
        "budget per test (setup + call + teardown): fast 10 s, vllm 10 s, default 10 s; enforced",
        "time per directory (3 tests, * s):",
        "  e2e      * s      1 tests  (default 1)",
        "  unit     * s      2 tests  (default 2)",
        "3 slowest tests (time / budget, tier):",
        "* s / 10 s    default e2e/test_e2e.py::test_slow",
        "exceptions (tests/budgets.py EXCEPTIONS): 0 listed, 0 ran"])
    # One test alone gets no report.
    assert "test budgets and durations" not in run("unit/test_unit.py::test_quick", tiers=ROOMY).stdout.str()


def test_stale_entries_are_named_after_a_full_collection(pytester: pytest.Pytester, run) -> None:  # type: ignore[no-untyped-def]
    pytester.makepyfile(test_a=QUICK + "def test_two():\n    pass\n",
                        test_skipped="import pytest\n\npytest.importorskip('no_such_module_here')\n")
    exceptions = {"test_a.py::test_quick": (5.0, "listed"), "test_a.py::test_gone": (5.0, "renamed"),
                  "test_skipped.py": (5.0, "skips at import here")}
    run(str(pytester.path), exceptions=exceptions).stdout.fnmatch_lines(
        ["stale: 1 tests/budgets.py EXCEPTIONS entries name no collected test (remove them): test_a.py::test_gone"])
    # A filtered run does not judge.
    run(str(pytester.path), "-k", "quick or two", exceptions=exceptions).stdout.no_fnmatch_line("stale:*")

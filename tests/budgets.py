"""Per-tier time budgets for tests, enforced, and the durations report (docs/testing.md).

``EXCEPTIONS`` below is the one place a test gets another budget than its tier's. tests/conftest.py loads
this file by path (the importlib import mode puts no test folder on ``sys.path``) and registers
``BudgetPlugin``.

Budgets
    A test's time is its setup, call and teardown durations as pytest measures them, so a module- or
    session-scoped fixture's set-up counts for the first test that uses it. Its budget is its tier's:
    ``vllm`` (it carries the ``vllm`` marker) 90 s, ``fast`` (the ``fast`` marker, tests/unit/conftest.py)
    1 s, ``default`` (every other test: unit tests that start processes, daemon and end-to-end tests)
    15 s; or its entry's in ``EXCEPTIONS``. A test that passed but ran over its budget fails at its
    teardown (pytest counts it as an error), with a message that names the budget and the way out. A test
    that failed or skipped is not failed again for its time. Budgets are per test: they bound how long a
    test may take to run, not how fast the product is.

Environment
    ``HKVD_TEST_BUDGETS=off`` reports without failing (a debugger, a slow laptop); ``on`` or unset
    enforces. ``HKVD_TEST_BUDGET_SCALE=F`` multiplies every budget by ``F`` > 0 (slower machines; CI uses 1).
"""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: Node id, parametrised family, class or module -> (its budget in seconds, why it needs that long).
#:
#: A key is, from the most to the least specific (the most specific key that matches a test wins):
#:
#: - a test's node id: ``"tests/e2e/test_x.py::test_y[qwen]"``;
#: - a test function or method without its parameters, for every parametrisation:
#:   ``"tests/e2e/test_x.py::test_y"``;
#: - a class, ending in ``"::"``: ``"tests/e2e/test_x.py::TestZ::"``;
#: - a module's path, for every test in it: ``"tests/e2e/test_x.py"``.
#:
#: The reason must say why the test cannot be faster or share a fixture (it must not be empty).
EXCEPTIONS: dict[str, tuple[float, str]] = {
    # fast tier (1 s): property-based tests, whose many generated cases are the point of them
    "tests/unit/test_snapshots.py::TestOrderingMachine::": (30.0, "stateful property test: 300 runs of up to 40 "
                                                           "steps against a model of Mamba step ordering"),
    "tests/unit/test_layout.py::test_segments_for_entries_match_reference": (20.0, "property test: 400 layouts "
                                                                             "against the reference copy plan"),
    "tests/unit/test_layout.py::test_segments_match_reference": (10.0, "property test: 400 layouts against the "
                                                                 "reference copy plan"),
    "tests/unit/test_layout.py::test_validate_bound_is_tight": (4.0, "property test: 200 layouts at the bound"),
    "tests/unit/test_hybrid.py::test_matches_brute_force": (12.0, "property test: 400 hybrid hits against a "
                                                            "brute-force search"),
    "tests/unit/test_hybrid.py::test_never_rounds_up": (3.0, "property test: 300 hybrid hits"),
    "tests/unit/test_chains.py::test_orphans_are_exactly_what_a_removal_makes_useless": (4.0, "property test: 400 "
                                                                                          "chains of entries"),
    "tests/unit/test_pool.py": (3.0, "property tests of the allocator: 50 to 200 random alloc/free sequences"),
    "tests/unit/test_heap.py": (30.0, "collects and freezes the whole heap, and writes and drops 2,000 entries of "
                                "two groups (4.6 to 10.9 s measured)"),
    "tests/unit/test_peer_units.py": (5.0, "property tests: extents and entries of random layouts, byte by byte "
                                      "(1.15 and 1.7 s measured on a busy machine)"),
    "tests/unit/test_index_writes.py": (3.0, "property test: batched writes against one-by-one writes"),
    "tests/unit/test_checksums.py::test_the_scrub_thread_catches_damage_on_its_own": (3.0, "waits for a pass of "
                                                                                        "the scrub thread"),
    "tests/unit/test_layers.py": (4.0, "parses every module of the product (the first test to run pays the parse)"),
    "tests/unit/test_usable_prefix.py::test_keep_alive_pipelined_answers_come_in_request_order": (3.0, "pipelined "
                                                                                                   "keep-alive "
                                                                                                   "requests over a "
                                                                                                   "real socket"),
    "tests/unit/test_wire.py::test_a_register_with_more_views_than_any_model_is_refused": (3.0, "encodes "
                                                                                            "registrations at the "
                                                                                            "wire's size bound"),
    "tests/unit/test_wire.py::test_view_pieces_are_bounded_in_all_groups_together": (3.0, "encodes views at the "
                                                                                      "wire's size bound"),
    "tests/unit/test_peer_links.py::test_a_peer_without_the_entries_answers_a_miss": (3.0, "starts a NIXL agent "
                                                                                        "on each side"),
    "tests/unit/test_budgets.py": (3.0, "runs pytest inside pytest (pytester), one or two sessions a test"),
    # default tier (15 s): soaks, fuzzing and network namespaces
    "tests/e2e/test_hugepages.py": (40.0, "waits on the kernel, up to 30 s a wait: for huge pages an exiting "
                                    "daemon still maps to go back, and for THP to back a pool; 30-31 s measured "
                                    "for two tests while vLLM installed beside them (CI's make test-unit)"),
    "tests/fault/test_soak.py::test_soak_keeps_rss_flat_and_leaves_nothing_behind": (150.0, "soak: thousands of "
                                                                                         "requests from several "
                                                                                         "engines, then RSS and "
                                                                                         "leftovers checked"),
    "tests/fault/test_soak.py::test_late_aborts_are_not_kept": (45.0, "soak: aborts that arrive after their "
                                                                "requests ended, by the thousand"),
    "tests/peer/test_peer_soak.py": (70.0, "soak: pulls between two daemons, then both daemons' memory checked"),
    "tests/fault/test_fuzz.py::test_fuzz_frames_get_typed_errors_and_hurt_no_one": (45.0, "fuzzes the daemon's "
                                                                                        "framing with thousands of "
                                                                                        "frames"),
    "tests/fault/test_memory_pressure.py::test_store_storm_over_capacity_evicts_per_policy_and_counts_every_failure":
        (30.0, "a store storm of twice the pool, per eviction policy"),
    "tests/peer/test_netns.py": (45.0, "two network namespaces, NIXL agents on both sides, links cut mid-pull"),
    "tests/cluster/test_cluster.py": (30.0, "a Mooncake master and two daemons in two network namespaces"),
    # vllm tier (90 s): engines of several processes each
    "tests/shim/test_tp_sizes_vllm.py": (240.0, "TP sizes 1 and 2 reading each other's entries: five engines (two "
                                         "references without hkvd, three with), three of them TP=2 with two "
                                         "worker processes each (305 s measured on a loaded 2-core machine); "
                                         "Qwen3-Next's GDN states likewise: five engines (65 s measured on an idle "
                                         "2-core machine)"),
    "tests/shim/test_mla_vllm.py": (240.0, "MLA stored once: a TP=1 reference without hkvd, two TP=2 engines (an "
                                    "engine core and two worker processes each) and a TP=1 engine (126 s measured "
                                    "on a 2-core machine shared with other work)"),
    "tests/shim/test_tp_vllm.py": (120.0, "TP=2: a cold and a warm engine, each an engine core and two worker "
                                   "processes (54 s measured)"),
    "tests/peer/test_pull_tp_sizes.py": (30.0, "two daemons per test, each starting its NIXL transport host, and "
                                         "synthetic engines of two TP sizes (2.4-3.6 s alone on a 2-core machine, "
                                         "10-15 s while vLLM engines ran beside them)"),
    "tests/peer/test_pd_vllm.py::test_tensor_parallel_pairs_of_the_same_and_of_another_tp_size":
        (300.0, "TP=2 prefill, decode and reference engines, then a TP=1 decode engine pulling across TP sizes and "
                "its TP=1 reference, each with processes of its own (220 s measured on a loaded 2-core machine, "
                "the session's engine zygote's start included)"),
    "tests/cluster/test_cluster_vllm.py": (150.0, "a Mooncake master, two daemons in two network namespaces and "
                                           "three engines (73 s measured, with the session's engine "
                                           "zygote's start)"),
    "tests/peer/test_pd_vllm.py::test_prefill_decode_pair_matches_a_single_engine": (150.0, "a prefill, a decode "
                                                                                          "and a single engine, and "
                                                                                          "the session's engine "
                                                                                          "zygote where it starts "
                                                                                          "first (66 s measured)"),
    "tests/shim/test_in_step_faults_vllm.py": (360.0, "four engines against one daemon that is SIGKILLed, stopped "
                                               "and restarted under them: four engine starts share two cores, "
                                               "then 28 prompts in five phases (186 s measured on a shared "
                                               "2-core machine under other tests' load)"),
    "tests/shim/test_load_overlap_vllm.py": (180.0, "a wide-KV model: a prefix of thousands of tokens loads beside "
                                             "a decoding request, in vLLM's own process topology"),
}

#: Each tier's budget per test, in seconds (before ``HKVD_TEST_BUDGET_SCALE``).
TIERS: dict[str, float] = {"fast": 1.0, "vllm": 90.0, "default": 15.0}

WHERE = "tests/budgets.py EXCEPTIONS"
SLOWEST = 30  # tests listed in the report
ENFORCE_ENV = "HKVD_TEST_BUDGETS"
SCALE_ENV = "HKVD_TEST_BUDGET_SCALE"

_PHASES = pytest.StashKey[dict[str, tuple[float, str]]]()


def tier_of(item: pytest.Item) -> str:
    """The test's tier: ``vllm`` before ``fast`` (a test that has both needs vLLM's time)."""
    if item.get_closest_marker("vllm") is not None:
        return "vllm"
    if item.get_closest_marker("fast") is not None:
        return "fast"
    return "default"


def candidate_keys(nodeid: str) -> list[str]:
    """The ``EXCEPTIONS`` keys that would name ``nodeid``, the most specific first."""
    bracket = nodeid.find("[")
    base = nodeid[:bracket] if bracket != -1 else nodeid
    parts = base.split("::")
    keys = [nodeid, base]
    keys += ["::".join(parts[:k]) + "::" for k in range(len(parts) - 1, 0, -1)]
    keys.append(parts[0])
    return list(dict.fromkeys(keys))


def find_entry(nodeid: str, exceptions: dict[str, tuple[float, str]]) -> str | None:
    return next((key for key in candidate_keys(nodeid) if key in exceptions), None)


def check_exceptions(exceptions: dict[str, tuple[float, str]]) -> None:
    """Raise ``pytest.UsageError`` naming the first malformed entry."""
    for key, value in exceptions.items():
        where = f"{WHERE}[{key!r}]"
        if not isinstance(key, str) or ".py" not in key.split("::", 1)[0] or key.startswith("/"):
            raise pytest.UsageError(f"{where}: a key is a node id, a test without its parameters, a class "
                                    "ending in '::' or a module path, relative to the checkout "
                                    "('tests/e2e/test_x.py::test_y')")
        if not (isinstance(value, tuple) and len(value) == 2):
            raise pytest.UsageError(f"{where}: the value is (seconds, reason), got {value!r}")
        seconds, reason = value
        if (isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds)
                or seconds <= 0):
            raise pytest.UsageError(f"{where}: the budget is a number of seconds > 0, got {seconds!r}")
        if not isinstance(reason, str) or not reason.strip():
            raise pytest.UsageError(f"{where}: the reason is empty; say why the test needs {seconds:g} s "
                                    "(and cannot be faster or share a fixture)")


def read_env(environ: Mapping[str, str]) -> tuple[bool, float]:
    """``(enforced, scale)`` from ``HKVD_TEST_BUDGETS`` and ``HKVD_TEST_BUDGET_SCALE``."""
    switch = environ.get(ENFORCE_ENV, "").strip().lower()
    if switch not in ("", "on", "off"):
        raise pytest.UsageError(f"{ENFORCE_ENV} is 'on' (the default) or 'off' (report budgets without "
                                f"failing), got {environ[ENFORCE_ENV]!r}")
    raw = environ.get(SCALE_ENV, "").strip()
    try:
        scale = float(raw) if raw else 1.0
    except ValueError:
        scale = math.nan
    if not math.isfinite(scale) or scale <= 0:
        raise pytest.UsageError(f"{SCALE_ENV} multiplies every test budget: a number > 0 such as 2.0 "
                                f"(1 unset), got {environ[SCALE_ENV]!r}")
    return switch != "off", scale


def _s(seconds: float) -> str:
    return f"{seconds:g} s"


@dataclass
class Record:
    """One test's time against its budget (kept for the report)."""

    nodeid: str
    group: str  # its top-level test directory, relative to the rootdir
    tier: str
    budget: float  # scaled
    entry: str | None  # its EXCEPTIONS key
    total: float
    over: bool  # it passed, in more time than its budget


class BudgetPlugin:
    """Enforces the budgets and prints the report. ``tiers`` and ``exceptions`` default to this module's."""

    def __init__(self, tests_dir: Path, tiers: dict[str, float] | None = None,
                 exceptions: dict[str, tuple[float, str]] | None = None) -> None:
        self.tests_dir = tests_dir.resolve()
        self.tiers = dict(TIERS if tiers is None else tiers)
        self.exceptions = EXCEPTIONS if exceptions is None else exceptions
        self.enforced, self.scale = True, 1.0
        self.records: list[Record] = []
        self.rootpath = self.tests_dir
        self.full_collection = False
        self.collected: list[str] = []
        self.skipped_collectors: list[str] = []

    # ---- configuration and collection ----------------------------------------------------------------------

    def pytest_configure(self, config: pytest.Config) -> None:
        check_exceptions(self.exceptions)
        self.enforced, self.scale = read_env(os.environ)
        self.rootpath = config.rootpath

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:  # a module skipped at import (pytest.importorskip): its entries are not stale
            self.skipped_collectors.append(report.nodeid)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        config, opt = session.config, session.config.option
        filtered = (opt.keyword or opt.markexpr or config.getoption("deselect", None) or getattr(opt, "lf", False)
                    or config.getoption("ignore", None) or config.getoption("ignore_glob", None))
        args = [Path(config.invocation_params.dir, a).resolve() for a in config.args]
        self.full_collection = not filtered and not session.testsfailed and args == [self.tests_dir]
        if self.full_collection:
            self.collected = [item.nodeid for item in session.items]

    # ---- enforcement ---------------------------------------------------------------------------------------

    def _group(self, path: Path) -> str:
        try:
            rel = path.resolve().relative_to(self.tests_dir)
            folder = self.tests_dir / rel.parts[0] if len(rel.parts) > 1 else self.tests_dir
        except ValueError:
            folder = path.resolve().parent
        return os.path.relpath(folder, self.rootpath)

    # The outermost wrapper (tryfirst): it sees each report as the other plugins leave it (an xfail's call
    # report skipped, a strict xpass's failed).
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report: pytest.TestReport = yield
        phases = item.stash.setdefault(_PHASES, {})
        if report.when == "setup":  # a test run again starts afresh
            phases.clear()
        phases[report.when] = (report.duration, report.outcome)
        if report.when != "teardown":
            return report
        tier = tier_of(item)
        entry = find_entry(item.nodeid, self.exceptions)
        budget = (self.exceptions[entry][0] if entry is not None else self.tiers[tier]) * self.scale
        total = sum(duration for duration, _ in phases.values())
        counted = "call" in phases and all(outcome == "passed" for _, outcome in phases.values())
        over = counted and total > budget
        if over and self.enforced:
            report.outcome = "failed"
            report.longrepr = self.message(item.nodeid, tier, entry, total, phases)
        # On the report (plain values), so that pytest_runtest_logreport also sees it where another process
        # ran the test.
        report.hkvd_budget = {"group": self._group(item.path), "tier": tier, "budget": budget, "entry": entry,
                              "total": total, "over": over}
        return report

    def message(self, nodeid: str, tier: str, entry: str | None, total: float,
                phases: dict[str, tuple[float, str]]) -> str:
        times = ", ".join(f"{when} {phases[when][0]:.2f} s" for when in ("setup", "call", "teardown"))
        scaled = f" x {self.scale:g} ({SCALE_ENV})" if self.scale != 1 else ""
        if entry is None:
            return (f"{nodeid} took {total:.2f} s, over the {tier} tier's budget of {_s(self.tiers[tier])}{scaled} "
                    f"({times}): make it faster, share the engine/daemon fixture, or list it with its reason in "
                    f"{WHERE} (docs/testing.md)")
        seconds, reason = self.exceptions[entry]
        return (f"{nodeid} took {total:.2f} s, over its budget of {_s(seconds)}{scaled} listed in "
                f"{WHERE}[{entry!r}] ({times}; listed because: {reason}): make it faster, or raise the listed "
                "budget with its reason (docs/testing.md)")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = getattr(report, "hkvd_budget", None)
        if report.when == "teardown" and isinstance(data, dict):
            self.records.append(Record(nodeid=report.nodeid, **data))

    # ---- the report ----------------------------------------------------------------------------------------

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if len(self.records) > 1:
            terminalreporter.write_sep("=", "test budgets and durations")
            for line in self.report_lines():
                terminalreporter.write_line(line)

    def report_lines(self) -> list[str]:
        records = self.records
        state = "enforced" if self.enforced else f"not enforced ({ENFORCE_ENV}=off)"
        scale = f", x {self.scale:g} ({SCALE_ENV})" if self.scale != 1 else ""
        lines = ["budget per test (setup + call + teardown): "
                 + ", ".join(f"{tier} {_s(b)}" for tier, b in self.tiers.items()) + f"{scale}; {state}"]

        groups: dict[str, list[Record]] = defaultdict(list)
        for r in records:
            groups[r.group].append(r)
        total = sum(r.total for r in records)
        lines.append(f"time per directory ({len(records)} tests, {total:.1f} s):")
        width = max(len(g) for g in groups)
        for group, rs in sorted(groups.items(), key=lambda kv: -sum(r.total for r in kv[1])):
            tiers = ", ".join(f"{t} {n}" for t, n in sorted(Counter(r.tier for r in rs).items()))
            lines.append(f"  {group:<{width}}  {sum(r.total for r in rs):9.2f} s  {len(rs):5d} tests  ({tiers})")

        slowest = sorted(records, key=lambda r: -r.total)[:SLOWEST]
        lines.append(f"{len(slowest)} slowest tests (time / budget, tier):")
        for r in slowest:
            tier = "listed" if r.entry is not None else r.tier
            mark = "  OVER" if r.over else ""
            lines.append(f"  {r.total:8.2f} s / {_s(r.budget):<7} {tier:<7} {r.nodeid}{mark}")

        by_entry: dict[str, list[Record]] = defaultdict(list)
        for r in records:
            if r.entry is not None:
                by_entry[r.entry].append(r)
        lines.append(f"exceptions ({WHERE}): {len(self.exceptions)} listed, {len(by_entry)} ran")
        for entry, rs in sorted(by_entry.items()):
            top = max(rs, key=lambda r: r.total)
            family = f" ({len(rs)} tests, slowest)" if len(rs) > 1 else ""
            mark = "  OVER" if any(r.over for r in rs) else ""
            lines.append(f"  {top.total:8.2f} s / {_s(top.budget):<7} {entry}{family}: "
                         f"{self.exceptions[entry][1]}{mark}")
        stale = self.stale_entries()
        if stale:
            lines.append(f"stale: {len(stale)} {WHERE} entries name no collected test (remove them): "
                         + ", ".join(stale))

        over = [r for r in records if r.over]
        if over:
            verdict = "failed" if self.enforced else f"not failed, {ENFORCE_ENV}=off"
            lines.append(f"over budget: {len(over)} test{'s' if len(over) > 1 else ''} ({verdict})")
        return lines

    def stale_entries(self) -> list[str]:
        """Entries that match no test of a full, unfiltered collection of the tests folder."""
        if not self.full_collection:
            return []
        matched = {find_entry(nodeid, self.exceptions) for nodeid in self.collected}
        return [key for key in self.exceptions
                if key not in matched and not any(key == c or key.startswith((f"{c}::", f"{c}/"))
                                                  for c in self.skipped_collectors)]


"""pytest plugin (``pytest11`` entry point ``faults``): options, markers and world fixtures.

Thin on purpose (like ``xdist.plugin``): options are constants in the "faults" group and the
fixtures delegate to :mod:`faults.world`. Nothing heavy is imported at plugin import time, so
every pytest run in an environment with refckpt installed stays cheap; torch is imported only
when a fixture that needs a world is used.

Markers:

* ``world_size(n)``: the size of the world the ``world`` fixture gives the test.
* ``backend(name, ...)``: the test only runs when the session's backend (``--backend``,
  resolved for the test's world size) is one of the names; otherwise it is skipped with the
  reason.
* ``gpu`` / ``npu``: the test needs a CUDA device / torch_npu and an Ascend NPU; skipped
  without one.
* ``slow``: expensive; deselect with ``-m "not slow"``.

With ``--kill-first`` (mutation testing), :class:`faults.killfirst.KillFirst` is registered as a
plugin of its own for the session; without it, none of that bookkeeping is loaded.

Marker skips are decided at collection and attached to the test as ``skip`` marks, so the
report names the test's own file and line with the reason (not this module). A malformed
``world_size`` or ``backend`` marker, or a bad option value, is a usage error.

Under ``torchrun`` (a process whose environment says it is a torchrun rank,
:func:`faults.world.torchrun_env`), every rank runs the session in lock-step and the world fixtures
give the job's own world (:class:`faults.world.TorchrunWorld`, made once per session): ``world``
and ``world_factory.get(n)`` for ``n`` equal to ``WORLD_SIZE``, a skip with the reason for any
other size and for ``fresh_world`` (its faults kill ranks). An inconsistent torchrun environment
is a usage error, and so is collecting ``faults.suite``: its tests keep their roots in per-rank
temporary directories and kill ranks; ``python -m faults torchrun-suite`` is what runs its
checks in a torchrun world.
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Any

import pytest

from faults.backends import BACKENDS
from faults.contract import DEFAULT_CHECKPOINTER
from faults.findings import ADVISORY_PROPERTY, STRICT_PREFIX

if TYPE_CHECKING:  # pragma: no cover - typing only
    from collections.abc import Iterator

    from faults.backends import BackendChoice
    from faults.world import TorchrunWorld, World

__all__ = ["WorldFactory", "FreshWorlds"]

OPT_BACKEND = "--backend"
OPT_WORLD_TIMEOUT = "--world-timeout"
OPT_WORLD_START = "--world-start"
OPT_CHECKPOINTER = "--checkpointer"
OPT_FAULT_BUDGET = "--fault-budget"
OPT_WORLD_SIZES = "--world-sizes"
OPT_STRICT_ADVISORIES = "--strict-advisories"
OPT_KILL_FIRST = "--kill-first"
BACKEND_CHOICES = BACKENDS
DEFAULT_BACKEND = "gloo"
DEFAULT_WORLD_TIMEOUT = 120.0
WORLD_GROUPS = 2  # xdist groups per world size

MARKERS = (
    "world_size(n): size of the world the `world` fixture provides to this test.",
    "backend(name, ...): run only when the session's backend (--backend) resolves to one of "
    "the names (gloo, nccl, hccl); skip otherwise.",
    "gpu: needs at least one CUDA device; skipped without one.",
    "npu: needs torch_npu and at least one Ascend NPU; skipped without one.",
    "slow: expensive test; deselect with -m 'not slow'.",
)
CONCRETE_BACKENDS = tuple(b for b in BACKENDS if b != "auto")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("faults", "faults: multi-process worlds for checkpoint tests")
    _add_start_option(group)
    parser.addini(INI_CHECKPOINTERS, type="linelist", default=[],
                  help="checkpointers (MODULE:FACTORY) the suite judges when no --checkpointer is given "
                       f"(default: {DEFAULT_CHECKPOINTER}).")
    group.addoption(
        OPT_CHECKPOINTER,
        action="append",
        default=None,
        metavar="MODULE:FACTORY",
        help="checkpointer the resilience suite (faults.suite) judges: a callable returning an "
        "object with save/load/find_latest_checkpoint/maybe_wait_for_async_save (default: "
        f"{DEFAULT_CHECKPOINTER}). Repeat it to judge several in one run (tests are parametrized).",
    )
    group.addoption(
        OPT_STRICT_ADVISORIES,
        action="store_true",
        help="fail the suite's tests on hardening advisories too (faults.contract.ADVISORY: e.g. errors "
        "that are not Exceptions, saving over a complete step in place); by default only contract "
        "violations fail and advisories are reported.",
    )
    group.addoption(
        OPT_KILL_FIRST,
        action="store_true",
        help="mutation testing: once a test fails for a --checkpointer, skip its remaining tests "
        "(the kill matrix needs the first failure, not all of them).",
    )
    group.addoption(
        OPT_WORLD_SIZES,
        default="1,2,4",
        metavar="N,N,...",
        help="world sizes the suite's multi-rank properties draw from (default: %(default)s).",
    )
    group.addoption(
        OPT_FAULT_BUDGET,
        type=int,
        default=8,
        metavar="N",
        help="examples per property of faults.suite (default: %(default)s; nightly: 200).",
    )
    group.addoption(
        OPT_BACKEND,
        choices=BACKEND_CHOICES,
        default=DEFAULT_BACKEND,
        help="process-group backend for test worlds; 'auto' picks nccl, then hccl, then gloo "
        "(default: %(default)s). A backend that cannot serve a world size skips its tests.",
    )
    group.addoption(
        OPT_WORLD_TIMEOUT,
        type=float,
        default=DEFAULT_WORLD_TIMEOUT,
        metavar="SECONDS",
        help="deadline for rendezvous, each run in a world and its close; on expiry every rank "
        "is killed (default: %(default)s).",
    )


INI_CHECKPOINTERS = "faults_checkpointers"


def _add_start_option(group) -> None:
    group.addoption(
        OPT_WORLD_START,
        choices=("forkserver", "spawn"),
        default="forkserver",
        help="how ranks start: 'forkserver' forks them from a server that imported torch once "
        "(~0.1 s a rank), 'spawn' starts a fresh interpreter each (~2 s) (default: %(default)s).",
    )


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    config.stash[_STATS] = {}
    config.stash[_ADVISED] = {}
    _check_options(config)
    _check_torchrun(config)
    if config.getoption(OPT_KILL_FIRST):
        from faults.killfirst import PLUGIN_NAME, KillFirst

        config.pluginmanager.register(KillFirst(checkpointer_specs(config)), PLUGIN_NAME)


def _check_options(config: pytest.Config) -> None:
    """Reject option values that could only fail later, inside some test or fixture."""
    world_sizes(config)
    if config.getoption(OPT_WORLD_TIMEOUT) <= 0:
        raise pytest.UsageError(f"{OPT_WORLD_TIMEOUT}={config.getoption(OPT_WORLD_TIMEOUT)}: expected seconds > 0")
    if config.getoption(OPT_FAULT_BUDGET) < 1:
        raise pytest.UsageError(f"{OPT_FAULT_BUDGET}={config.getoption(OPT_FAULT_BUDGET)}: expected at least 1 example")


_TORCHRUN = pytest.StashKey[Any]()  # the session's TorchrunEnv, or None


def _check_torchrun(config: pytest.Config) -> None:
    """Read the torchrun environment once; an inconsistent one stops the session."""
    from faults.world import TorchrunEnvError, torchrun_env

    try:
        config.stash[_TORCHRUN] = torchrun_env()
    except TorchrunEnvError as e:
        raise pytest.UsageError(str(e)) from None


def _torchrun(config: pytest.Config) -> Any:
    return config.stash.get(_TORCHRUN, None)


_STATS = pytest.StashKey[dict]()
_ADVISED = pytest.StashKey[dict]()
#: Configs of the sessions running in this process, innermost last: a ``pytester`` run
#: in-process nests a whole session inside a test, and must not take over the outer one's state.
_SESSIONS: list[pytest.Config] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect the suite's counters (examples, crashes, resumes) and its advisories."""
    if not _SESSIONS:
        return
    config = _SESSIONS[-1]
    for key, counts in getattr(report, "user_properties", ()):
        if key == "faults-suite" and isinstance(counts, dict):
            test = report.nodeid.split("[")[0].rsplit("::", 1)[-1]
            agg = config.stash[_STATS].setdefault(test, {})
            for k, v in counts.items():
                agg[k] = agg.get(k, 0) + v
        if key == ADVISORY_PROPERTY and report.when == "call":
            config.stash[_ADVISED].setdefault(report.nodeid, []).append(str(counts))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _SESSIONS.append(session.config)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.config in _SESSIONS:
        _SESSIONS.remove(session.config)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Attach the hardening advisories a test found (:mod:`faults.findings`) to its report;
    with ``--strict-advisories``, fail a test that found any."""
    from faults import findings

    findings.take()
    try:
        result = yield
    except BaseException:
        item.user_properties.extend((ADVISORY_PROPERTY, m) for m in findings.take())
        raise
    found = findings.take()
    item.user_properties.extend((ADVISORY_PROPERTY, m) for m in found)
    if found and item.config.getoption(OPT_STRICT_ADVISORIES):
        pytest.fail(STRICT_PREFIX + "\n".join(found), pytrace=False)
    return result


#: user property that marks a report whose test failed inside the harness (:class:`faults.errors.HarnessError`)
HARNESS_PROPERTY = "faults-harness-error"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A test that failed with a :class:`faults.errors.HarnessError` (an injector, a trace or a copy
    of the harness broke) is marked, so that it is reported as an ERROR naming the harness -- not as
    the checkpointer's FAILED violation."""
    report = yield
    if call.when == "call" and report.failed and call.excinfo is not None:
        from faults.errors import HarnessError

        if call.excinfo.errisinstance(HarnessError):
            report.user_properties.append((HARNESS_PROPERTY, str(call.excinfo.value)))
    return report


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    if report.when == "call" and report.failed and any(k == HARNESS_PROPERTY for k, _v in report.user_properties):
        return "error", "E", ("ERROR", {"red": True})
    return None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A 1-rank process group an adapter made for a single-process test ends with the test."""
    adapters = sys.modules.get("faults.adapters")
    if adapters is not None:
        adapters.release_process_group()


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    advised = config.stash.get(_ADVISED, {})
    if advised:
        terminalreporter.section("faults.suite: hardening advisories (pass; --strict-advisories fails them)")
        for nodeid, messages in sorted(advised.items()):
            for m in messages:
                terminalreporter.write_line(f"{nodeid}: {m}")
    stats = config.stash.get(_STATS, {})
    if not stats:
        return
    terminalreporter.section("faults.suite: what was exercised")
    for test, counts in sorted(stats.items()):
        terminalreporter.write_line(f"{test}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip what this machine or session cannot run (``gpu``, ``npu``, ``backend`` markers),
    and send the tests that use reused worlds of size n to two xdist workers
    (``--dist loadgroup``), alternating.

    Each xdist worker keeps its own worlds; without grouping, ``-n 8`` would hold eight
    4-rank worlds (and as many 1- and 2-rank ones) at once on a 2-core machine -- about 15 GB
    of rank processes for no speed-up. One group per size made the 4-rank tests one serial
    chain, the run's longest; two per size (one per core) keep memory bounded and both cores busy.
    """
    env = _torchrun(config)
    if env is not None:
        suite = [item.nodeid for item in items
                 if getattr(getattr(item, "module", None), "__name__", "").startswith("faults.suite.")]
        if suite:
            raise pytest.UsageError(
                f"faults.suite under torchrun (this is rank {env.rank} of {env.world_size}): its tests keep their "
                "checkpoint roots in per-rank temporary directories and kill ranks, so they cannot run in a torchrun "
                "job's world; run its checks that kill no rank with `torchrun ... -m faults torchrun-suite "
                "--checkpointer MODULE:FACTORY --root SHARED_DIR` (docs/faults.md, \"Running the harness under "
                f"torchrun\"), or the whole suite without torchrun (first: {suite[0]})")
    probes = _Probes(config)
    for item in items:
        reason = _marker_skip_reason(item, probes)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
    seen: dict[int, int] = {}
    for item in items:
        if "world_factory" not in getattr(item, "fixturenames", ()):
            continue
        n = item_world_size(item)
        if n is not None and item.get_closest_marker("xdist_group") is None:
            half = seen[n] = seen.get(n, -1) + 1
            item.add_marker(pytest.mark.xdist_group(f"faults-world-{n}-{half % WORLD_GROUPS}"))


def item_world_size(item: pytest.Item) -> int | None:
    """The number of ranks a collected test runs: its ``world_size`` or ``suite_world_size``
    parameter, else its ``world_size`` mark; None when it names none."""
    callspec = getattr(item, "callspec", None)
    n = callspec.params.get("world_size", callspec.params.get("suite_world_size")) if callspec is not None else None
    if n is None and item.get_closest_marker("world_size") is not None:
        n = _marked_world_size(item)
    return n if isinstance(n, int) else None


def xdist_group_name(item: pytest.Item) -> str | None:
    """The ``xdist_group`` a test belongs to, named as pytest-xdist names it (its marks' names,
    sorted and joined by ``_``), or None."""
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    return "_".join(names) or None


# trylast: after pytest-xdist's own hook, which means to do this.
@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_xdist_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Make ``--dist loadgroup`` keep each ``xdist_group`` on one worker under pytest 9.2 too.

    pytest-xdist (3.8) marks a grouped test by appending ``@group`` to ``item._nodeid``, and its
    controller schedules by that suffix of the ids a worker reports. pytest 9.2 keeps a test's id
    in ``item._id`` (a structured ``NodeId``) instead, so the suffix never took: every group was
    spread over every worker -- each of the eight kept its own worlds of 1, 2 and 4 ranks and ran
    the module-scoped runs (the benchmark's, the scale survey's) again. Here, on an xdist worker
    under loadgroup, a grouped test whose id lacks the suffix gets it, as xdist meant; ids that
    already carry it (pytest 8) are left alone. The suffix is read back off ids by
    :func:`faults.killfirst.strip_group`."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers only (and without xdist: absent)
        return
    for item in items:
        name = xdist_group_name(item)
        if name is None or item.nodeid.endswith(f"@{name}"):
            continue
        grouped = f"{item.nodeid}@{name}"
        node_id = getattr(item, "_id", None)
        if node_id is not None and type(node_id).__name__ == "NodeId":
            item._id = type(node_id).parse(grouped)  # pytest >= 9.2: str(NodeId.parse(s)) is s
        else:
            item._nodeid = grouped  # type: ignore[attr-defined]  # pytest < 9.2


class _Probes:
    """The hardware and backend answers the markers need, each asked once per collection
    (and only when some test carries the marker: torch is imported lazily)."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._cache: dict[Any, Any] = {}

    def _once(self, key: Any, compute) -> Any:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def cuda_devices(self) -> int:
        def count() -> int:
            import torch

            return torch.cuda.device_count()

        return self._once("cuda", count)

    def npu(self) -> tuple[bool, int, str]:
        from faults.backends import _npu_probe

        return self._once("npu", _npu_probe)

    def backend(self, world_size: int) -> BackendChoice | str:
        """The session's backend for ``world_size`` ranks, or why it cannot serve them."""
        from faults.backends import select_backend
        from faults.errors import BackendUnavailable

        def resolve() -> BackendChoice | str:
            try:
                return select_backend(self._config.getoption(OPT_BACKEND), world_size)
            except BackendUnavailable as e:
                return e.reason

        return self._once(("backend", world_size), resolve)


def _marker_skip_reason(item: pytest.Item, probes: _Probes) -> str | None:
    """Why ``item`` cannot run here because of its ``gpu``/``npu``/``backend`` markers, or None."""
    if item.get_closest_marker("gpu") is not None:
        found = probes.cuda_devices()
        if found < 1:
            return f"@pytest.mark.gpu: needs a CUDA device, torch.cuda.device_count() is {found}"
    if item.get_closest_marker("npu") is not None:
        importable, found, why = probes.npu()
        if not importable:
            return f"@pytest.mark.npu: needs torch_npu, which cannot be imported ({why})"
        if found < 1:
            return f"@pytest.mark.npu: needs an Ascend NPU, torch.npu.device_count() is {found}"
    marker = item.get_closest_marker("backend")
    if marker is not None:
        wanted = marker.args
        if not wanted or any(name not in CONCRETE_BACKENDS for name in wanted):
            raise pytest.UsageError(
                f"{item.nodeid}: @pytest.mark.backend{wanted!r}: expected one or more of "
                f"{', '.join(CONCRETE_BACKENDS)}"
            )
        got = probes.backend(_marked_world_size(item))
        if isinstance(got, str):  # the session's backend cannot serve this world size
            return got
        if got.backend not in wanted:
            names = " or ".join(wanted)
            return (f"@pytest.mark.backend: needs {names}, this session's backend is {got.backend} "
                    f"({OPT_BACKEND} {item.config.getoption(OPT_BACKEND)})")
    return None


def _resolve(config: pytest.Config, world_size: int) -> BackendChoice:
    """The backend for a world of ``world_size``, or skip the current test with the reason."""
    from faults.backends import select_backend
    from faults.errors import BackendUnavailable

    try:
        return select_backend(config.getoption(OPT_BACKEND), world_size)
    except BackendUnavailable as e:
        pytest.skip(e.reason)


def _marked_world_size(item: pytest.Item) -> int:
    """``n`` of the item's ``world_size(n)`` marker (1 without one)."""
    marker = item.get_closest_marker("world_size")
    if marker is None:
        return 1
    args = marker.args
    if len(args) != 1 or isinstance(args[0], bool) or not isinstance(args[0], int) or args[0] < 1:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.world_size{args!r}: expected one integer >= 1")
    return args[0]


class WorldFactory:
    """Session cache: one live :class:`World` per world size, replaced when not alive.

    Each pytest-xdist worker is its own process with its own session, so worlds are never
    shared across workers.
    """

    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._worlds: dict[int, World] = {}
        self._torchrun: TorchrunWorld | None = None

    def get(self, world_size: int) -> World | TorchrunWorld:
        env = _torchrun(self._config)
        if env is not None:
            return self._torchrun_world(env, world_size)
        world = self._worlds.get(world_size)
        if world is not None and world.alive:
            return world
        if world is not None:
            # A run that faulted it already raised in its own test, so close() is quiet then.
            # A rank that died outside any run (killed from outside, crashed between tests)
            # is not silently forgotten: it warns, naming the ranks and signals.
            try:
                world.close()
            except Exception as e:
                warnings.warn(
                    f"replacing a world whose ranks died outside a run: {e}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        world = _new_world(self._config, world_size)
        self._worlds[world_size] = world
        world.start()
        return world

    def _torchrun_world(self, env: Any, world_size: int) -> TorchrunWorld:
        """The job's own world (one per session); a test asking for another size is skipped."""
        if world_size != env.world_size:
            pytest.skip(f"under torchrun the world is the job's (WORLD_SIZE={env.world_size}); a world of "
                        f"{world_size} ranks cannot be made inside it (run this test without torchrun)")
        if self._torchrun is None or not self._torchrun.alive:
            if self._torchrun is not None:
                pytest.fail(f"{self._torchrun!r} died in an earlier test; a torchrun world is not replaced "
                            "(restart the job)", pytrace=False)
            from faults.backends import select_local_backend
            from faults.errors import BackendUnavailable
            from faults.world import TorchrunWorld

            try:
                choice = select_local_backend(self._config.getoption(OPT_BACKEND), env.local_rank, env.local_world_size)
            except BackendUnavailable as e:
                pytest.skip(e.reason)
            self._torchrun = TorchrunWorld(env, choice, self._config.getoption(OPT_WORLD_TIMEOUT)).start()
        return self._torchrun

    def close(self) -> None:
        """Close every cached world; a rank that did not exit cleanly is an error."""
        worlds, self._worlds = list(self._worlds.values()), {}
        torchrun, self._torchrun = self._torchrun, None
        _close_all(worlds)
        if torchrun is not None:
            torchrun.close()


class FreshWorlds:
    """Per-test factory of fresh worlds, all closed after the test (for faults that kill)."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._worlds: list[World] = []

    def __call__(self, world_size: int) -> World:
        return self.make(world_size)

    def make(self, world_size: int) -> World:
        if _torchrun(self._config) is not None:
            pytest.skip("fresh_world: under torchrun the world is the job's; fresh worlds are for faults that kill "
                        "ranks, and a torchrun job's ranks are torchrun's to kill and restart (run this test without "
                        "torchrun)")
        world = _new_world(self._config, world_size)
        self._worlds.append(world)
        world.start()
        return world

    def close(self) -> None:
        worlds, self._worlds = self._worlds, []
        _close_all(worlds)


def _new_world(config: pytest.Config, world_size: int) -> World:
    from faults.world import World

    return World(world_size, _resolve(config, world_size), config.getoption(OPT_WORLD_TIMEOUT),
                 start_method=config.getoption(OPT_WORLD_START))


def _close_all(worlds: list[World]) -> None:
    """Close every world (all of them, even after a failure); raise the first failure."""
    errors = []
    for world in worlds:
        try:
            world.close()
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]


def checkpointer_specs(config: pytest.Config) -> list[str]:
    """``--checkpointer`` values; without one, the ``faults_checkpointers`` ini list; else refckpt."""
    return config.getoption(OPT_CHECKPOINTER) or list(config.getini(INI_CHECKPOINTERS)) or [DEFAULT_CHECKPOINTER]


def world_sizes(config: pytest.Config) -> tuple[int, ...]:
    raw = config.getoption(OPT_WORLD_SIZES)
    try:
        sizes = tuple(sorted({int(x) for x in str(raw).split(",") if x.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(f"{OPT_WORLD_SIZES}={raw!r}: expected positive integers, e.g. 1,2,4")
    return sizes


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that judges a checkpointer runs once per ``--checkpointer``."""
    if "checkpointer_spec" in metafunc.fixturenames:
        specs = checkpointer_specs(metafunc.config)
        metafunc.parametrize("checkpointer_spec", specs, ids=specs, indirect=True, scope="session")
    if "suite_world_size" in metafunc.fixturenames:
        sizes = world_sizes(metafunc.config)
        metafunc.parametrize("suite_world_size", sizes, ids=[f"w{n}" for n in sizes])


@pytest.fixture(scope="session")
def checkpointer_spec(request: pytest.FixtureRequest) -> str:
    """``module:factory`` of the checkpointer under test (``--checkpointer``)."""
    return getattr(request, "param", None) or checkpointer_specs(request.config)[0]


@pytest.fixture(scope="session")
def suite_world_sizes(pytestconfig: pytest.Config) -> tuple[int, ...]:
    """``--world-sizes``: the world sizes the suite's multi-rank properties draw from."""
    return world_sizes(pytestconfig)


@pytest.fixture(scope="session")
def checkpointer_factory(checkpointer_spec: str):
    """The factory named by ``--checkpointer``; call it for a fresh checkpointer."""
    from faults.adapters import Unavailable
    from faults.training import load_factory

    try:
        return load_factory(checkpointer_spec)
    except Unavailable as e:  # an adapter whose package is not installed here
        pytest.skip(f"{checkpointer_spec}: {e}")


@pytest.fixture(scope="session")
def fault_budget(pytestconfig: pytest.Config) -> int:
    """Examples per property (``--fault-budget``)."""
    return pytestconfig.getoption(OPT_FAULT_BUDGET)


@pytest.fixture(scope="session")
def world_backend(pytestconfig: pytest.Config) -> BackendChoice:
    """The session's backend (``--backend``) resolved for one rank; skips if unavailable."""
    return _resolve(pytestconfig, 1)


@pytest.fixture(scope="session")
def world_factory(pytestconfig: pytest.Config) -> Iterator[WorldFactory]:
    """``world_factory.get(n)``: a live world of ``n`` ranks, reused across tests."""
    factory = WorldFactory(pytestconfig)
    yield factory
    factory.close()


@pytest.fixture
def fresh_world(pytestconfig: pytest.Config) -> Iterator[FreshWorlds]:
    """``fresh_world.make(n)``: a new world of ``n`` ranks, closed after the test."""
    factory = FreshWorlds(pytestconfig)
    yield factory
    factory.close()


@pytest.fixture
def world(request: pytest.FixtureRequest, world_factory: WorldFactory) -> Any:
    """A reused live world sized by the test's ``world_size(n)`` marker (default 1); under
    torchrun, the job's own world (:class:`faults.world.TorchrunWorld`) when the sizes match."""
    return world_factory.get(_marked_world_size(request.node))

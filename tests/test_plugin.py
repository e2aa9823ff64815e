"""The ``faults`` pytest plugin from the outside, as a user meets it: ``pytester`` writes test
files into a temporary directory and runs pytest on them.

Runs that start worlds, import torch or run the resilience suite use a fresh pytest process
(``runpytest_subprocess``), exactly as a user's ``pytest`` would (and so show that a fresh
process finds the plugin through its entry point). The others run in-process (a fresh process
costs seconds and would prove nothing more): options and markers, and runs that need a machine
other than this one (CUDA devices, an NPU), with the hardware probes of ``faults.backends``
replaced, the same seam ``select_backend``'s keyword arguments offer.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_RE = re.compile(r"<!-- plugin-example: (?P<name>\S+) -->\n```python\n(?P<code>.*?)```", re.S)
# A fresh pytest process starts in ~2 s, one that imports torch and starts a world in ~6 s;
# the limit only turns a hang into a failure.
SUBPROCESS_TIMEOUT = 180


# Plugins the inner runs do without: pytest-benchmark (if present) warns in every inner run
# under xdist; hypothesis's terminal summary imports hypothesis (~2 s) and nothing here uses it
# except the resilience suite.
QUIET = ("-p", "no:cacheprovider", "-p", "no:benchmark", "-p", "no:hypothesispytest")


def _plugin_args(pytestconfig) -> list[str]:
    """Arguments of an in-process run: an installed refckpt registers the plugin as "faults"
    via its entry point; loading it again by module name would register it twice."""
    if pytestconfig.pluginmanager.hasplugin("faults"):
        return list(QUIET)
    return [*QUIET, "-p", "faults.plugin"]


def _run(pytester, *args: str, quiet: tuple[str, ...] = QUIET):
    """pytest in a fresh process, in ``pytester.path``."""
    return pytester.runpytest_subprocess(*quiet, *args, timeout=SUBPROCESS_TIMEOUT)


def _readme_example() -> tuple[str, str]:
    """(file name, code) of the complete plugin example of docs/faults.md."""
    with open(os.path.join(ROOT, "docs", "faults.md"), encoding="utf-8") as f:
        match = EXAMPLE_RE.search(f.read())
    assert match, "docs/faults.md lost its '<!-- plugin-example: NAME -->' python block"
    return match["name"], match["code"]


def _npus_here() -> tuple[bool, int]:
    """(torch_npu importable, NPU count), asked of torch_npu directly."""
    if importlib.util.find_spec("torch_npu") is None:
        return False, 0
    import torch  # pragma: no cover - Ascend runners
    import torch_npu  # noqa: F401  # pragma: no cover

    return True, torch.npu.device_count()  # pragma: no cover


# ---------------------------------------------------------------------------------------
# Fresh pytest processes
# ---------------------------------------------------------------------------------------


@pytest.mark.slow(seconds=10)  # a fresh pytest process that imports torch
def test_readme_example_runs_a_real_world_and_skips_what_the_machine_lacks(pytester) -> None:
    """The test file of docs/faults.md, as is: a real 2-rank gloo all_reduce through ``world``, and the
    gpu / npu / backend markers skipped with their reasons at the test's own line -- or run,
    on a machine that has the device."""
    import torch

    name, code = _readme_example()
    pytester.makepyfile(**{name[:-3]: code})
    cuda = torch.cuda.device_count()
    npu_importable, npus = _npus_here()

    result = _run(pytester, name, "--backend", "gloo", "-rs", "-v")

    at = f"*SKIPPED ?1? {name}:*:"  # the test's own file, not the plugin's
    skipped = [f"{at} @pytest.mark.backend: needs nccl or hccl, this session's backend is gloo (--backend gloo)"]
    if cuda == 0:
        skipped.append(f"{at} @pytest.mark.gpu: needs a CUDA device, torch.cuda.device_count() is 0")
    if not npu_importable:
        skipped.append(f"{at} @pytest.mark.npu: needs torch_npu, which cannot be imported "
                       "(ModuleNotFoundError: *torch_npu*)")
    elif npus == 0:  # pragma: no cover - torch_npu without a device
        skipped.append("*@pytest.mark.npu: needs an Ascend NPU, torch.npu.device_count() is 0")
    result.assert_outcomes(passed=5 - len(skipped), skipped=len(skipped))
    for line in ["*::test_all_reduce PASSED*", "*::test_many_rounds PASSED*", *skipped]:
        result.stdout.fnmatch_lines([line])


@pytest.mark.slow(seconds=10)  # a fresh pytest process that imports torch
def test_own_checkpointer_through_the_suite(pytester) -> None:
    """The workflow of docs/faults.md for a checkpointer of one's own: ``--checkpointer`` names a factory
    in the user's package, the installed suite judges it. A careless variant that overwrites a
    committed step silently is failed by the same test in the same run."""
    pytester.mkpydir("mypkg")
    pytester.path.joinpath("mypkg", "ckpt.py").write_text(
        '''
from refckpt import DistributedCheckpointer


class MyCheckpointer:
    """The contract (faults.contract), delegating to refckpt (as an adapter over a framework's own
    would), declaring what it offers beyond it."""

    capabilities = ("root_save", "overwrite", "keep_last", "per_rank_extra_state", "priming")

    def __init__(self, **options):
        self._inner = DistributedCheckpointer(**options)

    def save(self, path, state, *, global_step, save_async=False):
        return self._inner.save(path, state, global_step=global_step, save_async=save_async)

    def load(self, path, state, *, strict_model=True, extra_state_skeleton=None):
        return self._inner.load(path, state, strict_model=strict_model,
                                extra_state_skeleton=extra_state_skeleton)

    def find_latest_checkpoint(self, root):
        return self._inner.find_latest_checkpoint(root)

    def maybe_wait_for_async_save(self):
        return self._inner.maybe_wait_for_async_save()

    def raise_for_failed_async_save(self):
        return self._inner.raise_for_failed_async_save()


def factory(**options):
    return MyCheckpointer(**options)


def careless(**options):
    return MyCheckpointer(**{**options, "overwrite": True})
'''
    )
    result = _run(pytester, "--pyargs", "faults.suite", "-v", "-k", "test_saving_over_a_complete_step_is_refused_or_safe",
                  "--checkpointer", "mypkg.ckpt:factory", "--checkpointer", "mypkg.ckpt:careless",
                  quiet=("-p", "no:cacheprovider"))
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*::test_saving_over_a_complete_step_is_refused_or_safe?mypkg.ckpt:factory? PASSED*",
        "*::test_saving_over_a_complete_step_is_refused_or_safe?mypkg.ckpt:careless? FAILED*",
    ])


# ---------------------------------------------------------------------------------------
# In-process: options and markers, and (with the hardware probes replaced) machines this one is not
# ---------------------------------------------------------------------------------------


def test_options_reach_the_fixtures(pytester, pytestconfig) -> None:
    pytester.makepyfile(
        """
        import pytest

        def test_options(pytestconfig, suite_world_sizes, fault_budget, checkpointer_spec):
            assert suite_world_sizes == (1, 3)
            assert fault_budget == 5
            assert checkpointer_spec == "mypkg.mod:factory"
            assert pytestconfig.getoption("--backend") == "gloo"
            assert pytestconfig.getoption("--world-timeout") == 30.0
            assert pytestconfig.getoption("--world-start") == "spawn"
            assert pytestconfig.getoption("--kill-first") is True

        def test_per_size(suite_world_size):
            assert suite_world_size in (1, 3)

        @pytest.mark.slow
        def test_slow():
            assert False, "deselected by -m 'not slow'"
        """
    )
    result = pytester.runpytest(*_plugin_args(pytestconfig), "-v", "--backend", "gloo", "--world-sizes", "3,1",
                                "--fault-budget", "5", "--checkpointer", "mypkg.mod:factory", "--world-timeout", "30",
                                "--world-start", "spawn", "--kill-first", "-m", "not slow")
    result.assert_outcomes(passed=3, deselected=1)
    result.stdout.fnmatch_lines(["*::test_options?mypkg.mod:factory? PASSED*", "*::test_per_size?w1? PASSED*",
                                 "*::test_per_size?w3? PASSED*"])


def test_markers_and_options_are_listed(pytester, pytestconfig) -> None:
    markers = pytester.runpytest(*_plugin_args(pytestconfig), "--markers")
    markers.stdout.fnmatch_lines([
        "@pytest.mark.world_size(n): size of the world the `world` fixture provides to this test.",
        "@pytest.mark.backend(name, ...): run only when the session's backend (--backend) resolves to one "
        "of the names (gloo, nccl, hccl); skip otherwise.",
        "@pytest.mark.gpu: needs at least one CUDA device; skipped without one.",
        "@pytest.mark.npu: needs torch_npu and at least one Ascend NPU; skipped without one.",
        "@pytest.mark.slow: expensive test; deselect with -m 'not slow'.",
    ])
    helptext = pytester.runpytest(*_plugin_args(pytestconfig), "--help")
    helptext.stdout.fnmatch_lines([
        "faults: multi-process worlds for checkpoint tests:",
        "*--world-start={forkserver,spawn}*",
        "*--checkpointer=MODULE:FACTORY*",
        "*--kill-first*",
        "*--world-sizes=N,N,...*",
        "*--fault-budget=N*",
        "*--backend={gloo,nccl,hccl,auto}*",
        "*--world-timeout=SECONDS*",
    ])


@pytest.fixture
def devices(monkeypatch):
    """Set what ``faults.backends`` finds: ``devices(cuda=N, npu=(importable, count))``."""
    import faults.backends

    def set_(cuda: int = 0, npu: tuple[bool, int] = (False, 0)) -> None:
        monkeypatch.setattr(faults.backends, "_cuda_count", lambda: cuda)
        monkeypatch.setattr(faults.backends, "_npu_probe",
                            lambda: (npu[0], npu[1], "" if npu[0] else "ModuleNotFoundError: no torch_npu"))

    return set_


def test_backend_that_cannot_serve_a_world_skips_with_the_reason(pytester, pytestconfig, devices) -> None:
    devices(cuda=0)
    pytester.makepyfile(
        """
        import pytest

        def test_needs_two(world_factory):
            world_factory.get(2)

        def test_backend(world_backend):
            pass

        @pytest.mark.world_size(4)
        def test_world(world):
            pass

        @pytest.mark.backend("nccl")
        def test_marked():
            pass
        """
    )
    result = pytester.runpytest(*_plugin_args(pytestconfig), "--backend", "nccl", "-rs")
    result.assert_outcomes(skipped=4)
    for world_size in (2, 4, 1):
        result.stdout.fnmatch_lines([f"*: nccl needs {world_size} CUDA devices, found 0; run with --backend gloo"])


def test_markers_follow_the_resolved_backend(pytester, pytestconfig, devices) -> None:
    """auto picks hccl for a world the NPUs can serve and gloo for one they cannot; the
    markers and ``world_backend`` follow that, per world size."""
    devices(cuda=0, npu=(True, 2))
    pytester.makepyfile(
        """
        import pytest

        def test_backend(world_backend, pytestconfig):
            assert (world_backend.backend, world_backend.device_type) == ("hccl", "npu")
            assert pytestconfig.getoption("--world-timeout") == 7.5

        @pytest.mark.backend("hccl")
        @pytest.mark.world_size(2)
        def test_hccl_at_two():
            pass

        @pytest.mark.backend("nccl", "hccl")
        @pytest.mark.npu
        def test_any_device():
            pass

        @pytest.mark.backend("hccl")
        @pytest.mark.world_size(4)
        def test_hccl_at_four():
            pass

        @pytest.mark.backend("nccl")
        def test_nccl():
            pass
        """
    )
    args = _plugin_args(pytestconfig)
    result = pytester.runpytest(*args, "--backend", "auto", "--world-timeout", "7.5", "-rs")
    result.assert_outcomes(passed=3, skipped=2)
    for line in ["*.py:*: @pytest.mark.backend: needs hccl, this session's backend is gloo (--backend auto)",
                 "*.py:*: @pytest.mark.backend: needs nccl, this session's backend is hccl (--backend auto)"]:
        result.stdout.fnmatch_lines([line])


def test_npu_marker_without_a_device(pytester, pytestconfig, devices) -> None:
    devices(npu=(True, 0))
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.npu
        def test_npu():
            pass
        """
    )
    result = pytester.runpytest(*_plugin_args(pytestconfig), "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*.py:*: @pytest.mark.npu: needs an Ascend NPU, torch.npu.device_count() is 0"])


def test_in_process_run_leaves_the_outer_session_alone(pytester, pytestconfig) -> None:
    """An in-process pytester run is a whole session inside this one; afterwards the suite's
    counters and --kill-first bookkeeping belong to this session again."""
    from faults import plugin

    assert plugin._SESSIONS[-1] is pytestconfig
    pytester.makepyfile("def test_nothing():\n    pass\n")
    pytester.runpytest(*_plugin_args(pytestconfig)).assert_outcomes(passed=1)
    assert plugin._SESSIONS[-1] is pytestconfig


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("world_size(0)", "test_bad_marker.py::test_it: @pytest.mark.world_size(0,): expected one integer >= 1"),
        ("world_size('2')", "*@pytest.mark.world_size('2',): expected one integer >= 1"),
        ("backend()", "*@pytest.mark.backend(): expected one or more of gloo, nccl, hccl"),
        ("backend('cuda')", "*@pytest.mark.backend('cuda',): expected one or more of gloo, nccl, hccl"),
    ],
)
def test_malformed_marker_is_a_usage_error(pytester, pytestconfig, marker: str, message: str) -> None:
    pytester.makepyfile(test_bad_marker=f"""
        import pytest

        @pytest.mark.{marker}
        def test_it(world):
            pass
        """)
    result = pytester.runpytest(*_plugin_args(pytestconfig))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--world-sizes", "0"], "ERROR: --world-sizes='0': expected positive integers, e.g. 1,2,4"),
        (["--world-sizes", "two"], "ERROR: --world-sizes='two': expected positive integers, e.g. 1,2,4"),
        (["--world-timeout", "0"], "ERROR: --world-timeout=0.0: expected seconds > 0"),
        (["--fault-budget", "0"], "ERROR: --fault-budget=0: expected at least 1 example"),
        (["--backend", "mpi"], "*--backend: invalid choice: 'mpi' (choose from *gloo*nccl*hccl*auto*)"),
    ],
)
def test_bad_option_value_is_a_usage_error(pytester, pytestconfig, option: list[str], message: str) -> None:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest(*_plugin_args(pytestconfig), *option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


@pytest.mark.parametrize(("nodeid", "bare"), [
    ("faults/suite/test_contract.py::test_x[refckpt:DistributedCheckpointer]@checkpointer-refckpt:DistributedCheckpointer",
     "faults/suite/test_contract.py::test_x[refckpt:DistributedCheckpointer]"),
    ("faults/suite/test_x.py::test_y[tests.mutants:no_checksum-w2]@faults-world-2-0",
     "faults/suite/test_x.py::test_y[tests.mutants:no_checksum-w2]"),
    ("tests/test_bench.py::test_exit_code_and_cleanup@refckpt-bench", "tests/test_bench.py::test_exit_code_and_cleanup"),
    ("faults/suite/test_x.py::test_y[a-b]", "faults/suite/test_x.py::test_y[a-b]"),
])
def test_loadgroup_suffix_is_not_part_of_the_checkpointer_spec(nodeid, bare):
    """pytest-xdist's ``--dist loadgroup`` appends ``@group`` to test ids (with pytest 8; with
    pytest 9.2 its suffix does not take). The kill matrix and ``--kill-first`` read the
    checkpointer spec out of the id: a suffix left on made every test parametrized by the spec
    alone look like no checkpointer's, and two mutants 'survived' (seen under pytest 8.4)."""
    from faults.killfirst import spec_of, strip_group

    assert strip_group(nodeid) == bare
    if "[" in nodeid:
        specs = ["refckpt:DistributedCheckpointer", "tests.mutants:no_checksum", "a"]
        assert spec_of(nodeid, specs) == spec_of(bare, specs) is not None


def test_loadgroup_keeps_each_group_on_one_worker(pytester):
    """Under ``-n 3 --dist loadgroup`` every test of an ``xdist_group`` runs on one worker, its id
    carrying the ``@group`` suffix -- with pytest 9.2 too, where xdist's own suffix does not take
    and the groups were spread over every worker (each holding its own worlds)."""
    pytester.makepyfile(test_groups="""
        import os
        import pytest

        @pytest.mark.parametrize(("group", "i"), [pytest.param(g, i, marks=pytest.mark.xdist_group(g))
                                                  for g in "ab" for i in range(6)])
        def test_grouped(group, i, request):
            assert request.node.nodeid.endswith("@" + group)
            with open(os.path.join(os.environ["GROUPS_OUT"], f"{group}{i}"), "w") as f:
                f.write(os.environ["PYTEST_XDIST_WORKER"])

        @pytest.mark.parametrize("i", range(6))
        def test_free(i, request):
            assert "@" not in request.node.nodeid
    """)
    out = pytester.mkdir("out")
    os.environ["GROUPS_OUT"] = str(out)
    try:
        result = _run(pytester, "-n", "3", "--dist", "loadgroup")
    finally:
        del os.environ["GROUPS_OUT"]
    result.assert_outcomes(passed=18)
    for g in "ab":
        workers = {(out / f"{g}{i}").read_text() for i in range(6)}
        assert len(workers) == 1, f"group {g} ran on {sorted(workers)}"

"""The suite on a checkpointer without a commit record (``tests/recordless_ckpt.py``, issue 28): the
faults that damage a record, or delete it, do not apply -- they skip, saying so; they never crash in
the harness as the checkpointer's violation ("no commit record" as a FileNotFoundError), and
``missing_commit`` never deletes nothing and then demands a fallback from an intact step. A link out
of the root is judged by what resume loaded through it."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = "tests.recordless_ckpt:make"
RECORD_TESTS = [
    f"faults/suite/test_contract.py::test_each_kind_of_damage_falls_back_to_the_previous_step[{SPEC}-missing_commit]",
    f"faults/suite/test_integrity.py::test_record_rewritten_unchanged_still_resumes[{SPEC}]",
    *(f"faults/suite/test_integrity.py::test_damaged_record_or_file_falls_back_without_hanging[{SPEC}-{kind}]"
      for kind in ("bitflip_record", "truncated_record", "corrupt_record_field", "forged_record_field")),
    f"faults/suite/test_exact_resume.py::test_hostile_bytes_stay_within_a_memory_bound[{SPEC}-record_of_objects]",
]
#: Its extra-state file linked to another run's identical one: resume loads exactly this run's state
#: through the link, which is judged by what was loaded (a pass), not as a violation.
LINK_TEST = f"faults/suite/test_links.py::test_file_linked_out_of_the_root[{SPEC}-extra_state]"


def test_record_faults_skip_with_the_reason_on_a_checkpointer_without_a_record():
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "-n", "0",
                        "--checkpointer", SPEC, *RECORD_TESTS, LINK_TEST],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    skipped = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    assert not failed, "\n".join(failed) + out[-3000:]
    # missing_commit, the control, four record kinds, the hostile record: each skipped for having no record
    assert len(skipped) == 7, out[-3000:]
    assert all("no commit record" in ln for ln in skipped), skipped
    assert f"PASSED {LINK_TEST}" in out, out[-3000:]

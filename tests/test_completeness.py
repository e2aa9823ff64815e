"""The suite's completeness oracle (:class:`faults.suite._common.Completeness`) asks the
checkpointer itself whether a step is complete. A checkpointer that finds its step only through a
pointer file of its own (DeepSpeed's ``latest``, holding a tag) must be asked with that pointer
beside the step: without it, every complete step read as "acknowledged save lost" (a false alarm
the audit of DeepSpeed showed on every state-machine run)."""

from __future__ import annotations

import os

from faults.suite._common import Completeness


class OwnPointer:
    """Finds a step only through ``root/latest`` (a tag: the step directory's name), like DeepSpeed."""

    def find_latest_checkpoint(self, root):
        try:
            with open(os.path.join(root, "latest")) as f:
                tag = f.read().strip()
        except OSError:
            return None
        path = os.path.join(root, tag)
        return path if os.path.isfile(os.path.join(path, "weights.pt")) else None


class FindsNothing:
    def find_latest_checkpoint(self, root):
        return None


def _step(root, step: int, *, complete: bool = True) -> None:
    d = root / f"global_step_{step}"
    d.mkdir()
    if complete:
        (d / "weights.pt").write_bytes(b"w" * 64)


def test_a_step_found_through_the_checkpointers_own_pointer_is_complete(tmp_path):
    _step(tmp_path, 1)
    _step(tmp_path, 2)
    _step(tmp_path, 3, complete=False)
    (tmp_path / "latest").write_text("global_step_3")  # names the newest tag, here an incomplete one
    committed = Completeness(OwnPointer)
    assert committed(tmp_path, 1) and committed(tmp_path, 2)  # the copied pointer is rewritten to name each
    assert not committed(tmp_path, 3)
    assert "returned None" in committed.why(tmp_path, 3)
    assert not committed(tmp_path, 4) and "not on disk" in committed.why(tmp_path, 4)


def test_a_whole_number_pointer_is_rewritten_and_a_large_file_is_not_copied(tmp_path):
    class NumberPointer(OwnPointer):
        def find_latest_checkpoint(self, root):
            try:
                with open(os.path.join(root, "latest")) as f:
                    return os.path.join(root, f"global_step_{int(f.read())}")
            except (OSError, ValueError):
                return None

    _step(tmp_path, 5)
    (tmp_path / "latest").write_text("7\n")
    assert Completeness(NumberPointer)(tmp_path, 5)
    (tmp_path / "latest").write_bytes(b"7" * 10_000)  # not a pointer: a payload is never copied
    assert not Completeness(NumberPointer)(tmp_path, 5)


def test_a_checkpointer_that_finds_nothing_is_never_told_complete(tmp_path):
    _step(tmp_path, 1)
    (tmp_path / "latest").write_text("global_step_1")
    assert not Completeness(FindsNothing)(tmp_path, 1)

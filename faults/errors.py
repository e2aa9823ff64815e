"""The errors a :class:`faults.world.World` raises, and why a backend cannot serve a world.

Every one subclasses :class:`WorldError` and a builtin (``RuntimeError``, ``TimeoutError``), so a
caller may catch either. A dead rank is named with its signal (``RankDied.signal``), a rank error
carries the remote traceback, and a timeout the Python stack of every thread of the ranks that hung.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["WorldError", "BackendUnavailable", "RankError", "RankDied", "WorldTimeout", "WorldCloseError",
           "HarnessError", "harness"]


class HarnessError(Exception):
    """The harness itself failed (an injector, a trace, a copy), not the checkpointer under test.
    ``faults.plugin`` reports a test that raised one as an ERROR naming the harness, never as the
    checkpointer's FAILED violation; ``python -m faults audit`` counts it as a harness error."""


#: the prefix of a harness error's message, which the plugin and the audit look for
HARNESS_PREFIX = "harness error in "


@contextmanager
def harness(what: str) -> Iterator[None]:
    """Run a harness step (``what``: the function, as a user would look it up): an error raised
    inside becomes a :class:`HarnessError` naming it. ``FaultNotApplicable`` (a fault this
    machine or checkpointer cannot take: a skip) and ``HarnessError`` pass through unchanged."""
    try:
        yield
    except HarnessError:
        raise
    except Exception as e:
        from .inject import FaultNotApplicable

        if isinstance(e, FaultNotApplicable):
            raise
        raise HarnessError(f"{HARNESS_PREFIX}{what}: {type(e).__module__}.{type(e).__qualname__}: {e} (a bug in "
                           "the faults harness, not a finding about the checkpointer; please report it)") from e


class WorldError(Exception):
    """Root of the errors a :class:`faults.world.World` raises (each also subclasses a builtin)."""


class BackendUnavailable(WorldError, RuntimeError):
    """The requested backend cannot serve the requested world size on this machine.

    ``reason`` says what is missing and how to run anyway; the plugin skips with it.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RankError(WorldError, RuntimeError):
    """A rank's function raised. Carries the remote exception and traceback text.

    ``rank``/``exc_type``/``exc_message``/``remote_traceback`` describe the first error
    received; ``errors`` maps every rank that raised to ``(exc_type, message, traceback)``;
    ``unanswered`` lists ranks that had not answered when the world was killed.
    """

    def __init__(
        self,
        rank: int,
        exc_type: str,
        exc_message: str,
        remote_traceback: str,
        *,
        errors: dict[int, tuple[str, str, str]] | None = None,
        unanswered: list[int] | None = None,
        what: str = "",
    ) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.errors = dict(errors or {rank: (exc_type, exc_message, remote_traceback)})
        self.unanswered = list(unanswered or [])
        lines = [f"rank {rank} raised {exc_type}: {exc_message}" + (f" in {what}" if what else "")]
        others = sorted(r for r in self.errors if r != rank)
        if others:
            lines.append(
                "also raised: "
                + "; ".join(f"rank {r}: {self.errors[r][0]}: {self.errors[r][1]}" for r in others)
            )
        if self.unanswered:
            lines.append(
                f"ranks {self.unanswered} had not answered (probably blocked in a collective "
                "with the failed rank); all ranks were killed"
            )
        lines.append(f"--- remote traceback (rank {rank}) ---")
        lines.append(remote_traceback.rstrip())
        super().__init__("\n".join(lines))


class RankDied(WorldError, RuntimeError):
    """A rank process exited (or was killed by a signal) without answering.

    ``signal`` is the signal's name (``'SIGKILL'`` for exit code -9) or None.
    """

    def __init__(self, rank: int, exitcode: int | None, *, what: str = "") -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.signal = signal_name(exitcode)
        how = (
            f"was killed by {self.signal}"
            if self.signal
            else f"exited with code {exitcode}"
        )
        where = f" while running {what}" if what else ""
        super().__init__(f"rank {rank} (exit code {exitcode}) {how}{where}; all ranks were killed")


class WorldTimeout(WorldError, TimeoutError):
    """Not every rank answered within the timeout; every rank was SIGKILLed.

    ``stacks``: rank -> the Python stack of every thread of that rank at the timeout
    (faulthandler), so a hang names the call it hung in, not only the harness's wait."""

    def __init__(self, unanswered: list[int], timeout: float, *, what: str = "",
                 stacks: dict[int, str] | None = None) -> None:
        self.unanswered = list(unanswered)
        self.timeout = timeout
        self.stacks = dict(stacks or {})
        where = f" running {what}" if what else ""
        shown = "".join(f"\n--- rank {r}: Python stack of every thread at the timeout ---\n{t.rstrip()}"
                        for r, t in sorted(self.stacks.items()) if t.strip())
        super().__init__(
            f"ranks {self.unanswered} did not answer within {timeout:g} s{where}; "
            "all ranks were killed (SIGKILL)" + shown
        )


class WorldCloseError(WorldError, RuntimeError):
    """Ranks did not shut down cleanly (no ack, or a non-zero exit code at close)."""


def signal_name(exitcode: int | None) -> str | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"

"""The resilience suite: properties any checkpointer that follows the contract must satisfy.

The contract is :mod:`faults.contract` (the seed family's ``save``/``load`` on step directories,
``find_latest_checkpoint``, the async waits), and everything beyond it is a capability the
checkpointer declares; tests of undeclared capabilities skip, saying which. Run it against your
own checkpointer::

    pytest --pyargs faults.suite -n 8 --dist loadgroup --checkpointer=package.module:factory --fault-budget 50

or, for a findings table with severities, ``python -m faults audit --checkpointer ...``.

It judges only through the contract's methods and their behaviour, never through a
checkpointer's internals or a file name: the oracle is what the suite itself did (which steps it
saved, which it damaged), digests it recomputed by training from scratch, and -- for "is this step
complete?" -- the checkpointer's own ``find_latest_checkpoint`` on a copy of that step alone, whose
answer resume must then honour bitwise. Which file is which is learned (``faults.fileroles``: an
inotify trace of a load and the saved tensors' bytes found in each file). What a checkpointer
lacks (sync only, plain tensors only, no commit record, no pointer, registered-object extra
state) it declares as a :class:`faults.contract.Limitation`; the suite then draws only what it
can take. A crash inside the harness is a pytest ERROR naming the harness, never a violation. A
failed test is a contract violation; hardening advisories pass and are listed
(``--strict-advisories`` fails them).
"""

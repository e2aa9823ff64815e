"""The resilience suite: properties any checkpointer that follows the contract must satisfy.

The contract is :mod:`faults.contract` (the seed family's ``save``/``load`` on step directories,
``find_latest_checkpoint``, the async waits), and everything beyond it is a capability the
checkpointer declares; tests of undeclared capabilities skip, saying which. Run it against your
own checkpointer::

    pytest --pyargs faults.suite -n 8 --dist loadgroup --checkpointer=package.module:factory --fault-budget 50

or, for a findings table with severities, ``python -m faults audit --checkpointer ...``.

It judges only through the contract's methods and the on-disk layout, never through a
checkpointer's internals: the oracle is what the suite itself did (which steps it saved,
which it damaged) and digests it recomputed by training from scratch, not anything the
checkpointer reports. A failed test is a contract violation; hardening advisories pass and are
listed (``--strict-advisories`` fails them).
"""

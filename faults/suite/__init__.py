"""The resilience suite: properties any checkpointer with the harness interface must satisfy.

Run it against your own checkpointer::

    pytest --pyargs faults.suite -n 8 --checkpointer=package.module:factory --fault-budget 50

It judges only through the on-disk contract (DESIGN.md) and the interface
(``save``/``load``/``find_latest_checkpoint``/``maybe_wait_for_async_save``), never through
refckpt's internals: the oracle is what the suite itself did (which steps it saved, which it
damaged) and digests it recomputed, not anything the checkpointer reports.
"""

"""User tools that read (and convert) checkpoints; none of them needs the fault harness.

* :mod:`refckpt.tools.readers`: ``ls`` (:func:`list_root`), ``verify`` and ``inspect``
  (:func:`inspect_step`), read-only; checkpoint bytes are parsed by the safe loader only.
* :mod:`refckpt.tools.convert`: refckpt/DCP/``torch.save`` conversions.
* :mod:`refckpt.tools.example`: ``refckpt example``, train on gloo ranks and resume bitwise.
* :mod:`refckpt.tools.cli`: the ``refckpt`` command, which only parses arguments and prints.
"""

from .readers import inspect_step, list_root, optimizer_kind, verify

__all__ = ["inspect_step", "list_root", "optimizer_kind", "verify"]

"""DCP storage: safetensors shards, a checksummed commit record, and a safe reader.

The writer (:class:`SafetensorsWriter`) runs steps 3 and 5 of the save protocol, whose numbered
steps are the docstring of :mod:`refckpt.commit`; the reader (:class:`SafetensorsReader`) verifies
every item against the commit record's checksums as it reads. Modules, one per seam:

* :mod:`~refckpt.storage.shards`: the shard format (one safetensors file per rank, raw bytes);
* :mod:`~refckpt.storage.writer` and :mod:`~refckpt.storage.reader`: DCP's storage interfaces;
* :mod:`~refckpt.storage.checksums`: the checksum registry (algorithms by the name a manifest records);
* :mod:`~refckpt.storage.crc`: the CRC pipe (checksums folded beside the I/O);
* :mod:`~refckpt.storage.verify`: whole-step verification (``refckpt verify``).
"""

from .checksums import DEFAULT_CHECKSUM, checksum_fn
from .reader import SafetensorsReader
from .shards import BYTES_KEY_PREFIX, SHARD_SUFFIX, tensor_bytes, tensor_to_bytes
from .verify import verify_file_bytes, verify_step_files
from .writer import SafetensorsWriter

__all__ = [
    "SafetensorsWriter",
    "SafetensorsReader",
    "BYTES_KEY_PREFIX",
    "SHARD_SUFFIX",
    "DEFAULT_CHECKSUM",
    "checksum_fn",
    "verify_step_files",
    "verify_file_bytes",
    "tensor_bytes",
    "tensor_to_bytes",
]

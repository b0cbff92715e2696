"""Checks on what comes from outside, done before any work on it: files read with a byte cap (a device or a pipe
reports no size, so its st_size is never trusted), a GGUF file's header read before the file is hashed, and the GPU
memory a run is given."""

from __future__ import annotations

import functools
import math
import os
import stat
import struct
import sys
from pathlib import Path

from gguf import GGUF_MAGIC
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from core.config import TriForceError, UnusableModelError

STDIN = "-"
MAX_GPU_MEMORY_GIB = 1024.0  # no GPU has more; a larger figure is a typo
GGUF_HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version, tensor count, metadata key-value count
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, dimension count, type, offset: a tensor's entry is no shorter
MIN_KV_BYTES = 8 + 4  # key length and value type


def read_capped(path: str | Path, limit: int, name: str | None = None) -> bytes:
    """The bytes of a regular file, or of stdin for "-", refused (TriForceError) past `limit` bytes: at most
    limit + 1 are read. A directory, device, FIFO or socket is refused without waiting on it."""
    name = name or ("stdin" if str(path) == STDIN else str(path))
    if str(path) == STDIN:
        data = sys.stdin.buffer.read(limit + 1)
    else:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO for reading would wait for a writer
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise TriForceError(f"{name} is not a regular file (a directory, device or pipe); give a file"
                                f"{', or - for stdin' if name == str(path) else ''}")
        with open(fd, "rb") as f:
            data = f.read(limit + 1)
    if len(data) > limit:
        raise TriForceError(f"{name} is larger than the limit of {limit / 2**20:.3g} MiB")
    return data


def check_gguf_header(path: Path) -> None:
    """Refuse (UnusableModelError) a file whose header is not a GGUF model's: the magic, a version the gguf package
    reads (in either byte order, as it does), and tensor and key-value counts that the file is long enough to hold."""
    with open(path, "rb") as f:
        head = f.read(GGUF_HEADER_BYTES)
    size, reason = path.stat().st_size, None
    if head[:4] != struct.pack("<I", GGUF_MAGIC):
        reason = f"not a GGUF file: it starts with {head[:4].hex() or 'nothing'}"
    elif len(head) < GGUF_HEADER_BYTES:
        reason = f"its header is cut short: {size} bytes"
    else:
        fields = [struct.unpack(order + "IQQ", head[4:]) for order in "<>"]  # little-endian, or else big-endian
        version, tensors, kvs = next((f for f in fields if f[0] in READER_SUPPORTED_VERSIONS), fields[0])
        if version not in READER_SUPPORTED_VERSIONS:
            reason = f"GGUF version {version}; readable: {', '.join(map(str, READER_SUPPORTED_VERSIONS))}"
        elif not tensors or tensors * MIN_TENSOR_INFO_BYTES + kvs * MIN_KV_BYTES > size:
            reason = f"its header declares {tensors:,} tensors and {kvs:,} metadata entries in {size:,} bytes"
    if reason:
        raise UnusableModelError(f"{path.name}: cannot load ({reason})")


def gpu_memory_gib(text: str) -> float:
    """GiB of GPU memory from text, refused (TriForceError) unless a finite number above 0 and at most
    MAX_GPU_MEMORY_GIB."""
    try:
        gib = float(text)
    except ValueError:
        raise TriForceError(f"GPU memory must be a number of GiB, got {text!r}") from None
    if not (math.isfinite(gib) and 0 < gib <= MAX_GPU_MEMORY_GIB):
        raise TriForceError(f"GPU memory must be above 0 and at most {MAX_GPU_MEMORY_GIB:g} GiB, got {text}")
    return gib


@functools.cache
def note_gpu_only(setting: str, device_type: str) -> None:
    """Say on stderr, once per process, that the GPU-only `setting` has no effect on a device that is not a GPU."""
    print(f"note: {setting} has no effect here: the models run on {device_type}, not a GPU", file=sys.stderr)

"""Checks on what comes from outside, done before any work on it: files read with a byte cap (a device or a pipe
reports no size, so its st_size is never trusted), a GGUF file's header read before the file is hashed, the GPU
memory a run is given, and the process group the environment describes."""

from __future__ import annotations

import functools
import math
import os
import stat
import struct
import sys
from collections.abc import Mapping
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


def gpu_only_note(setting: str, device_type: str) -> str:
    """That the GPU-only `setting` has no effect on a device that is not a GPU (the app and the CLI say it alike)."""
    return f"{setting} has no effect here: the models run on {device_type}, not a GPU"


@functools.cache
def note_gpu_only(setting: str, device_type: str) -> None:
    """Say on stderr, once per process, that the GPU-only `setting` has no effect on a device that is not a GPU."""
    print(f"note: {gpu_only_note(setting, device_type)}", file=sys.stderr)


def _whole(environ: Mapping[str, str], name: str, low: int, high: int, default: str, what: str) -> int:
    """The whole number an environment variable holds (`default` when unset), refused (TriForceError) outside
    low..high."""
    text = environ.get(name, default).strip()
    value = int(text) if text.isdigit() else -1  # digits only: no sign, no space, no underscore
    if not low <= value <= high:
        raise TriForceError(f"{name} must be {what}, got {text[:40]!r}")
    return value


def process_group(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """WORLD_SIZE and RANK of this process's tensor-parallel group as torchrun (or `--tp`'s launch) sets them (1 and
    0 outside a group), refused (TriForceError) in one line unless whole numbers with RANK below WORLD_SIZE, and,
    for a group of more than one process, unless the rendezvous its processes meet at is set (MASTER_ADDR and a
    MASTER_PORT): without it torch.distributed would fail with a traceback."""
    env = os.environ if environ is None else environ
    world = _whole(env, "WORLD_SIZE", 1, 1 << 20, "1", "a whole number of processes, 1 or more")
    rank = _whole(env, "RANK", 0, world - 1, "0", f"a whole number below WORLD_SIZE ({world})")
    if world > 1:
        if missing := [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name, "").strip()]:
            raise TriForceError(f"WORLD_SIZE={world} but no rendezvous: {' and '.join(missing)} "
                                f"{'is' if len(missing) == 1 else 'are'} unset; start the processes with torchrun, "
                                "or one process with --tp N")
        _whole(env, "MASTER_PORT", 1, 65535, "", "a port number from 1 to 65535")
        if "LOCAL_RANK" in env:
            _whole(env, "LOCAL_RANK", 0, world - 1, "", f"a whole number below WORLD_SIZE ({world})")
    return world, rank

"""Packed messages for rerouted communication: pack / unpack / scale_accumulate.

When a failed stage's micro-batches are rerouted, a rank sends many small tensors (activations and
gradients of several micro-batches) to several peers, and adds the gradients it receives into its
gradient buffers. Sending one packed message per peer instead of one message per tensor saves the
per-message latency; ``scale_accumulate`` adds a whole received message into the destination
tensors in one call.

API
    pack(tensors) -> uint8 tensor          one buffer: header + 16-byte aligned data
    unpack(buffer, copy=False) -> list     the tensors, as views into ``buffer`` (see below)
    scale_accumulate(dst, buffer, scale)   dst[i] += scale * tensor_i, in float32
    packed_nbytes(specs) -> int            size of pack() of tensors / (shape, dtype) pairs
    backend() -> "cuda" | "cpp" | "torch"  which implementation runs

Implementations: the compiled extension ``chameleon_ext.comm._C`` (csrc/; C++ always, CUDA kernels
where it was built with CUDA) when it imports and ``CHAMELEON_NO_EXT`` is not ``1``, else the pure
torch code in this module. Both give the same bytes, the same values bit for bit and the same
error messages (tests/unit/test_comm.py). Which one is used is logged once, at INFO level.

Layout (version 1, all integers little-endian)::

    offset size  field
    0      4     magic 0x4B504843 (the bytes "CHPK")
    4      2     version = 1
    6      2     reserved = 0
    8      4     count: number of tensors
    12     4     header_bytes = 24 + sum over tensors of (24 + 8 * ndim)
    16     8     total_bytes: size of the whole buffer (a multiple of 16)
    24     ...   count entries, each 24 + 8 * ndim bytes:
                   +0 u8 dtype code, +1 u8 ndim (<= 64), +2 u16 reserved = 0, +4 u32 reserved = 0,
                   +8 u64 byte offset of the data (from the buffer start, a multiple of 16),
                   +16 u64 byte length (= numel * itemsize), +24 i64 shape[ndim]
    then the data: tensor 0 at align16(header_bytes), each next one at the next multiple of 16
    after the previous one's end; every gap is zero bytes; total_bytes = align16(end of last).

dtype codes: 1 float32, 2 float16, 3 bfloat16, 4 float64, 5 int64, 6 int32, 7 int16, 8 int8,
9 uint8, 10 bool. A tensor's data is its elements in row-major (C) order, whatever its strides.

``unpack`` and ``scale_accumulate`` validate the whole header before touching any data (magic,
version, reserved fields, counts, every entry inside header_bytes, known dtype codes, shape
product x itemsize == byte length, offsets aligned, non-overlapping and inside the buffer) and
raise ``ValueError("malformed packed buffer: ...")`` naming what is wrong; they never read past the
buffer. A buffer longer than total_bytes is accepted (the tail is ignored), so a receiver may use
a preallocated buffer of ``packed_nbytes(...)`` bytes or more.

Aliasing: ``unpack`` returns views into ``buffer`` (no copy; writing to them writes the buffer and
they keep it alive), except when ``buffer``'s data is not 16-byte aligned, in which case they are
views into a private aligned copy. ``copy=True`` returns independent tensors.

Arithmetic of scale_accumulate: exactly ``dst.add_(src.float(), alpha=scale)`` for each tensor,
i.e. in float32 with ``scale`` rounded to float32. torch's CPU kernels compute that as a fused
multiply-add (one rounding) where its vectorised path uses FMA (AVX2 / AVX-512 / NEON) and as
multiply-then-add (two roundings) otherwise; CUDA fuses. The first call on a device type probes
torch once and tells the extension which of the two to do, so both paths agree bit for bit.
The fused loops cover float32 contiguous destinations with float32 / float16 / bfloat16 / float64
sources; any other destination (non-contiguous, bf16, ...) or source dtype runs as that torch op.

Buffers on a GPU: the header is copied to the host (a small synchronous copy) to be validated.
This module imports torch and the standard library only.
"""

from __future__ import annotations

import logging
import math
import os
import struct
from typing import Iterable, Sequence

import torch

__all__ = ["pack", "unpack", "scale_accumulate", "packed_nbytes", "backend", "MAGIC", "VERSION",
           "ALIGN", "DTYPE_CODES"]

_log = logging.getLogger(__name__)

MAGIC = 0x4B504843  # b"CHPK" read as a little-endian u32
VERSION = 1
ALIGN = 16
FIXED_HEADER_BYTES = 24
ENTRY_BYTES = 24  # per entry, before its 8 * ndim shape bytes
MAX_NDIM = 64
_FLT_MAX = 3.4028234663852886e38

DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
               torch.int64: 5, torch.int32: 6, torch.int16: 7, torch.int8: 8, torch.uint8: 9,
               torch.bool: 10}
_CODE_DTYPES = {code: dt for dt, code in DTYPE_CODES.items()}
_SUPPORTED = "float32, float16, bfloat16, float64, int64, int32, int16, int8, uint8, bool"
_BAD = "malformed packed buffer: "

_FIXED = struct.Struct("<IHHIIQ")
_ENTRY = struct.Struct("<BBHIQQ")


# ---- which implementation ---------------------------------------------------------------------
def _load_ext():
    if os.environ.get("CHAMELEON_NO_EXT", "") == "1":
        return None, "disabled by CHAMELEON_NO_EXT=1"
    try:
        from chameleon_ext.comm import _C  # noqa: PLC0415 (optional compiled module)
    except ImportError as exc:
        return None, f"chameleon_ext.comm._C is not importable ({exc})"
    try:
        version = _C.format_version()
    except Exception as exc:  # a stale or foreign build
        return None, f"chameleon_ext.comm._C is unusable ({exc})"
    if version != VERSION:
        return None, f"chameleon_ext.comm._C writes format version {version}, this module {VERSION}"
    return _C, ""


_C, _EXT_REASON = _load_ext()
_announced = False


def backend() -> str:
    """'cuda' (extension with CUDA kernels), 'cpp' (extension, CPU kernels) or 'torch'."""
    if _C is None:
        return "torch"
    return "cuda" if _C.cuda_built() else "cpp"


def _announce() -> None:
    global _announced
    if _announced:
        return
    _announced = True
    name = backend()
    if name == "torch":
        _log.info("packed comm backend: torch (pure-torch fallback: %s)", _EXT_REASON)
    else:
        _log.info("packed comm backend: %s (chameleon_ext.comm._C, cpu loops: %s)",
                  name, _C.cpu_variant())


# ---- how torch computes dst.add_(src, alpha=a) in float32 ----------------------------------------
_MADD_MODE: dict[str, int] = {}


def _madd_mode(device: torch.device) -> int:
    """1: torch's add_(alpha=) is one fused multiply-add, 0: multiply then add, 2: neither
    everywhere (the extension then calls torch itself). Probed once per device type."""
    key = device.type
    mode = _MADD_MODE.get(key)
    if mode is None:
        a = 1.0 + 2.0 ** -12  # a * a = 1 + 2^-11 + 2^-24: the last bit is lost when rounded
        fused, unfused = 2.0 ** -11 + 2.0 ** -24, 2.0 ** -11
        results = set()
        try:
            for n in (1, 7, 67, 1031):  # scalar tails and vector bodies
                d = torch.full((n,), -1.0, dtype=torch.float32, device=device)
                s = torch.full((n,), a, dtype=torch.float32, device=device)
                d.add_(s, alpha=a)
                results.update(d.cpu().tolist())
        except Exception:  # a device that cannot run the probe: let torch do the arithmetic
            results = set()
        mode = 1 if results == {fused} else 0 if results == {unfused} else 2
        _MADD_MODE[key] = mode
    return mode


# ---- layout helpers -----------------------------------------------------------------------------
def _align(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


def packed_nbytes(specs: Iterable) -> int:
    """Size in bytes of ``pack()`` of these tensors; each spec is a tensor or a (shape, dtype)
    pair. A receiver can allocate its buffer with this before the message arrives."""
    shapes = []
    for spec in specs:
        if isinstance(spec, torch.Tensor):
            shapes.append((tuple(spec.shape), spec.dtype))
        else:
            shape, dtype = spec
            shapes.append((tuple(shape), dtype))
    header = FIXED_HEADER_BYTES + sum(ENTRY_BYTES + 8 * len(s) for s, _ in shapes)
    cursor = _align(header)
    for shape, dtype in shapes:
        cursor = _align(cursor + math.prod(shape) * torch.empty((), dtype=dtype).element_size())
    return cursor


# ---- pure-torch implementation ------------------------------------------------------------------
def _check_pack_inputs(tensors: list) -> None:
    if len(tensors) > 0xFFFFFFFF:
        raise ValueError(f"pack: too many tensors ({len(tensors)})")
    device = tensors[0].device if tensors else None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pack: element {i} is not a tensor")
        if t.layout != torch.strided:
            raise ValueError(f"pack: tensor {i} is not a dense (strided) tensor")
        if t.device != device:
            raise ValueError(f"pack: tensor {i} is on {t.device} but tensor 0 is on {device}")
        if t.dtype not in DTYPE_CODES:
            raise ValueError(f"pack: tensor {i} has an unsupported dtype (supported: {_SUPPORTED})")
        if t.dim() > MAX_NDIM:
            raise ValueError(f"pack: tensor {i} has {t.dim()} dimensions, more than 64")


def _torch_pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    tensors = list(tensors)
    _check_pack_inputs(tensors)
    n = len(tensors)
    header_bytes = FIXED_HEADER_BYTES + sum(ENTRY_BYTES + 8 * t.dim() for t in tensors)
    if header_bytes > 0xFFFFFFFF:
        raise ValueError("pack: header too large")
    data_start = _align(header_bytes)
    nbytes = [t.numel() * t.element_size() for t in tensors]
    offsets, cursor = [], data_start
    for nb in nbytes:
        offsets.append(cursor)
        cursor = _align(cursor + nb)
    total = cursor

    header = bytearray(data_start)
    _FIXED.pack_into(header, 0, MAGIC, VERSION, 0, n, header_bytes, total)
    pos = FIXED_HEADER_BYTES
    for t, off, nb in zip(tensors, offsets, nbytes):
        _ENTRY.pack_into(header, pos, DTYPE_CODES[t.dtype], t.dim(), 0, 0, off, nb)
        struct.pack_into(f"<{t.dim()}q", header, pos + ENTRY_BYTES, *t.shape)
        pos += ENTRY_BYTES + 8 * t.dim()

    device = tensors[0].device if tensors else torch.device("cpu")
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    with torch.no_grad():
        buf[:data_start].copy_(torch.frombuffer(header, dtype=torch.uint8))
        for t, off, nb in zip(tensors, offsets, nbytes):
            end = off + nb
            if _align(end) > end:
                buf[end:_align(end)].zero_()
            if nb:
                buf[off:end].view(t.dtype).view(t.shape).copy_(t)
    return buf


def _check_buffer(buffer) -> None:
    if not (isinstance(buffer, torch.Tensor) and buffer.layout == torch.strided
            and buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.is_contiguous()):
        raise ValueError("packed buffer must be a 1-D contiguous uint8 tensor")


def _host_bytes(buffer: torch.Tensor, n: int):
    part = buffer[:n]
    return (part if part.device.type == "cpu" else part.cpu()).numpy()


def _parse_header(buffer: torch.Tensor):
    """Validate the header (the same checks, in the same order, as csrc/comm.cpp) and return
    (count, [(dtype, shape, offset, nbytes), ...])."""
    _check_buffer(buffer)
    n = buffer.numel()
    if n < FIXED_HEADER_BYTES:
        raise ValueError(_BAD + f"truncated: {n} bytes is shorter than the 24-byte fixed header")
    magic, version, reserved, count, hb, total = _FIXED.unpack_from(
        _host_bytes(buffer, FIXED_HEADER_BYTES), 0)
    if magic != MAGIC:
        raise ValueError(_BAD + f"bad magic 0x{magic:08x} (expected 0x4b504843, 'CHPK')")
    if version != VERSION:
        raise ValueError(_BAD + f"unsupported version {version} (this build reads version 1)")
    if reserved != 0:
        raise ValueError(_BAD + f"reserved field of the fixed header is {reserved}, expected 0")
    if total > n:
        raise ValueError(_BAD + f"truncated: header declares {total} bytes but the buffer has {n}")
    if not FIXED_HEADER_BYTES <= hb <= total:
        raise ValueError(_BAD + f"header_bytes {hb} out of range [24, {total}]")
    if count > (hb - FIXED_HEADER_BYTES) // ENTRY_BYTES:
        raise ValueError(_BAD + f"count {count} does not fit in header_bytes {hb}")

    raw = _host_bytes(buffer, hb)
    cursor, prev_end, entries = FIXED_HEADER_BYTES, _align(hb), []
    for i in range(count):
        if cursor + ENTRY_BYTES > hb:
            raise ValueError(_BAD + f"entry {i} extends past header_bytes {hb}")
        code, ndim, res16, res32, offset, nbytes = _ENTRY.unpack_from(raw, cursor)
        dtype = _CODE_DTYPES.get(code)
        if dtype is None:
            raise ValueError(_BAD + f"entry {i}: unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise ValueError(_BAD + f"entry {i}: ndim {ndim} exceeds 64")
        if res16 or res32:
            raise ValueError(_BAD + f"entry {i}: reserved bytes are not zero")
        if cursor + ENTRY_BYTES + 8 * ndim > hb:
            raise ValueError(_BAD + f"entry {i}: shape extends past header_bytes {hb}")
        shape = list(struct.unpack_from(f"<{ndim}q", raw, cursor + ENTRY_BYTES))
        for d in shape:
            if d < 0:
                raise ValueError(_BAD + f"entry {i}: negative dimension {d} in shape {shape}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(shape) * itemsize != nbytes:
            raise ValueError(_BAD + f"entry {i}: byte length {nbytes} does not match shape {shape}"
                             f" x itemsize {itemsize}")
        if offset % ALIGN:
            raise ValueError(_BAD + f"entry {i}: offset {offset} is not 16-byte aligned")
        if offset < prev_end:
            raise ValueError(_BAD + f"entry {i}: offset {offset} overlaps the header or the "
                             f"previous tensor (data may start at {prev_end})")
        if offset > total or nbytes > total - offset:
            raise ValueError(_BAD + f"entry {i}: bytes [{offset}, {offset}+{nbytes}) out of range"
                             f" of the {total}-byte buffer")
        prev_end = offset + nbytes
        cursor += ENTRY_BYTES + 8 * ndim
        entries.append((dtype, shape, offset, nbytes))
    if cursor != hb:
        raise ValueError(_BAD + f"header_bytes {hb} does not match the {cursor} bytes of the "
                         f"{count} entries")
    if total != _align(prev_end):
        raise ValueError(_BAD + f"total_bytes {total} does not match the {_align(prev_end)} bytes"
                         " implied by the entries")
    return count, entries


def _aligned_base(buffer: torch.Tensor) -> torch.Tensor:
    if buffer.data_ptr() % ALIGN == 0 and buffer.storage_offset() % ALIGN == 0:
        return buffer
    return buffer.clone()


def _views(base: torch.Tensor, entries) -> list[torch.Tensor]:
    return [base[off:off + nb].view(dtype).view(shape) for dtype, shape, off, nb in entries]


def _torch_unpack(buffer: torch.Tensor, copy: bool = False) -> list[torch.Tensor]:
    _, entries = _parse_header(buffer)
    with torch.no_grad():
        out = _views(_aligned_base(buffer), entries)
        return [t.clone() for t in out] if copy else out


def _check_scale(scale: float) -> None:
    if math.isfinite(scale) and abs(scale) > _FLT_MAX:
        raise ValueError("scale_accumulate: |scale| exceeds the float32 range")


def _torch_scale_accumulate(dst: Sequence[torch.Tensor], buffer: torch.Tensor,
                            scale: float) -> None:
    scale = float(scale)
    _check_scale(scale)
    count, entries = _parse_header(buffer)
    dst = list(dst)
    if len(dst) != count:
        raise ValueError(f"scale_accumulate: {len(dst)} destination tensors for a packed buffer "
                         f"of {count} tensors")
    for i, (d, (_, shape, _, _)) in enumerate(zip(dst, entries)):
        if not isinstance(d, torch.Tensor) or d.layout != torch.strided:
            raise ValueError(f"scale_accumulate: destination {i} is not a dense (strided) tensor")
        if d.device != buffer.device:
            raise ValueError(f"scale_accumulate: destination {i} is on {d.device} but the packed "
                             f"buffer is on {buffer.device}")
        if not d.is_floating_point():
            raise ValueError(f"scale_accumulate: destination {i} is not a floating-point tensor")
        if list(d.shape) != shape:
            raise ValueError(f"scale_accumulate: destination {i} has shape {list(d.shape)} but "
                             f"the packed tensor has shape {shape}")
    with torch.no_grad():
        for d, s in zip(dst, _views(_aligned_base(buffer), entries)):
            d.add_(s.float(), alpha=scale)


# ---- public API ---------------------------------------------------------------------------------
def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Pack ``tensors`` (any strides, empty and 0-d allowed, one device) into one uint8 buffer on
    their device (CPU for an empty list). See the module docstring for the layout."""
    _announce()
    if _C is not None:
        if not isinstance(tensors, (list, tuple)):
            tensors = list(tensors)
        return _C.pack(tensors)
    return _torch_pack(tensors)


def unpack(buffer: torch.Tensor, copy: bool = False) -> list[torch.Tensor]:
    """The tensors of a packed buffer, after validating its header (ValueError when malformed).
    Views into ``buffer`` unless ``copy`` (see the module docstring)."""
    _announce()
    if _C is not None:
        _check_buffer(buffer)
        return _C.unpack(buffer, copy)
    return _torch_unpack(buffer, copy)


def scale_accumulate(dst: Sequence[torch.Tensor], buffer: torch.Tensor,
                     scale: float = 1.0) -> None:
    """``dst[i].add_(tensor_i.float(), alpha=scale)`` for every tensor of the packed ``buffer``,
    bit for bit, after checking the header, the count and the shapes (ValueError otherwise)."""
    _announce()
    if _C is not None:
        if not isinstance(dst, (list, tuple)):
            dst = list(dst)
        _check_buffer(buffer)
        _C.scale_accumulate(dst, buffer, float(scale), _madd_mode(buffer.device))
        return
    _torch_scale_accumulate(dst, buffer, scale)

"""chameleon_ext.comm.packed: packed messages for rerouted traffic.

The compiled path (chameleon_ext.comm._C) and the pure-torch fallback must write the same bytes, read
back the same tensors, raise the same errors on malformed headers, and accumulate bit for bit the
same values. Tests that need the extension are skipped, with the reason, when it is not built.
"""

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chameleon_ext.comm import packed as comm

ROOT = Path(__file__).resolve().parents[2]
HAVE_EXT = comm._C is not None
needs_ext = pytest.mark.skipif(
    not HAVE_EXT, reason=f"chameleon_ext.comm._C is not built ({comm._EXT_REASON}); "
    "extension-specific tests skipped (build with: pip install --no-build-isolation -e .)")

PACKERS = {"torch": comm._torch_pack}
UNPACKERS = {"torch": comm._torch_unpack}
ACCUMULATORS = {"torch": comm._torch_scale_accumulate}
if HAVE_EXT:
    PACKERS["ext"] = comm._C.pack
    UNPACKERS["ext"] = lambda buf, copy=False: comm._C.unpack(buf, copy)
    ACCUMULATORS["ext"] = lambda dst, buf, scale: comm._C.scale_accumulate(
        dst, buf, float(scale), comm._madd_mode(buf.device))
PATHS = sorted(PACKERS)

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
ALL_DTYPES = FLOATS + (torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
                       torch.uint8, torch.bool)


def _rand(shape, dtype, gen):
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen).to(dtype)


def _random_tensors(seed, dtypes=ALL_DTYPES, k=None):
    """Random mixes of shapes and layouts: empty, 0-d, odd sizes, transposed, sliced, strided,
    expanded (stride 0) and offset views (data not 16-byte aligned)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k or int(torch.randint(1, 9, (1,), generator=gen))):
        dtype = dtypes[int(torch.randint(len(dtypes), (1,), generator=gen))]
        kind = int(torch.randint(8, (1,), generator=gen))
        a, b = (int(x) for x in torch.randint(1, 40, (2,), generator=gen))
        if kind == 0:
            t = _rand((a, b), dtype, gen)
        elif kind == 1:
            t = _rand((a, b), dtype, gen).t()  # transposed
        elif kind == 2:
            t = _rand((a, 2 * b + 1), dtype, gen)[:, ::2]  # strided slice
        elif kind == 3:
            t = _rand((a * b + 3,), dtype, gen)[3:]  # offset view, contiguous
        elif kind == 4:
            t = _rand((), dtype, gen)  # 0-d
        elif kind == 5:
            t = _rand((a, 0, 3) if a % 2 else (0,), dtype, gen)  # empty
        elif kind == 6:
            t = _rand((1, b), dtype, gen).expand(a, b)  # stride 0
        else:
            t = _rand((2, a, 3), dtype, gen).permute(2, 0, 1)[1:]
        out.append(t)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


# ---- layout -------------------------------------------------------------------------------------
def test_backend_reports_the_path_in_use():
    assert comm.backend() in ("cuda", "cpp", "torch")
    assert (comm.backend() == "torch") == (comm._C is None)


@pytest.mark.parametrize("path", PATHS)
def test_header_layout_is_the_documented_one(path):
    t0 = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t1 = torch.tensor(7, dtype=torch.int64)
    buf = PACKERS[path]([t0, t1])
    raw = bytes(buf.numpy())
    hb = 24 + (24 + 16) + (24 + 0)
    assert raw[:4] == b"CHPK"
    magic, version, reserved, count, header_bytes, total = struct.unpack_from("<IHHIIQ", raw)
    assert (magic, version, reserved, count, header_bytes) == (comm.MAGIC, 1, 0, 2, hb)
    off0 = (hb + 15) // 16 * 16
    off1 = (off0 + 24 + 15) // 16 * 16
    assert total == buf.numel() == off1 + 16 == comm.packed_nbytes([t0, ((), torch.int64)])
    assert struct.unpack_from("<BBHIQQ2q", raw, 24) == (1, 2, 0, 0, off0, 24, 2, 3)
    assert struct.unpack_from("<BBHIQQ", raw, 64) == (5, 0, 0, 0, off1, 8)
    assert raw[hb:off0] == bytes(off0 - hb) and raw[off0 + 24:off1] == bytes(off1 - off0 - 24)
    assert raw[off0:off0 + 24] == t0.numpy().tobytes()
    assert raw[off1:off1 + 8] == struct.pack("<q", 7) and raw[off1 + 8:] == bytes(8)


@pytest.mark.parametrize("path", PATHS)
def test_empty_list(path):
    buf = PACKERS[path]([])
    assert buf.numel() == 32 and UNPACKERS[path](buf) == []


# ---- round trips and bit identity --------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seed", range(12))
def test_round_trip(path, seed):
    tensors = _random_tensors(seed)
    buf = PACKERS[path](tensors)
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.numel() % 16 == 0
    assert buf.numel() == comm.packed_nbytes(tensors)
    out = UNPACKERS[path](buf)
    assert len(out) == len(tensors)
    for a, b in zip(out, tensors):
        assert _same(a, b) and a.is_contiguous()
        assert a.numel() == 0 or a.data_ptr() % 16 == 0


@needs_ext
@pytest.mark.parametrize("seed", range(40))
def test_pack_bytes_identical_to_fallback(seed):
    tensors = _random_tensors(seed)
    assert torch.equal(comm._C.pack(tensors), comm._torch_pack(tensors))


@needs_ext
def test_pack_large_parallel_copy_identical():
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(128, 2, 256, generator=gen) for _ in range(8)]  # 2 MiB: threaded copy
    tensors += [torch.randn(300, 301, generator=gen).t(), torch.randn(5).to(torch.bfloat16)]
    assert torch.equal(comm._C.pack(tensors), comm._torch_pack(tensors))


@needs_ext
@pytest.mark.parametrize("seed", range(6))
def test_unpack_identical_across_paths(seed):
    buf = comm._torch_pack(_random_tensors(seed))
    for a, b in zip(comm._C.unpack(buf), comm._torch_unpack(buf)):
        assert _same(a, b)


@pytest.mark.parametrize("path", PATHS)
def test_unpack_views_and_copies(path):
    buf = PACKERS[path]([torch.ones(4), torch.zeros(2, 2, dtype=torch.float16)])
    views = UNPACKERS[path](buf)
    views[0][1] = 5.0  # a view writes through to the buffer
    assert UNPACKERS[path](buf)[0][1].item() == 5.0
    copies = UNPACKERS[path](buf, copy=True)
    copies[0][2] = 9.0
    assert UNPACKERS[path](buf)[0][2].item() == 1.0


@pytest.mark.parametrize("path", PATHS)
def test_unpack_misaligned_buffer(path):
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int32), torch.randn(2).double()]
    buf = PACKERS[path](tensors)
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), buf])[3:]  # data_ptr % 16 == 3
    for a, b in zip(UNPACKERS[path](shifted), tensors):
        assert _same(a, b)


@pytest.mark.parametrize("path", PATHS)
def test_longer_buffer_is_accepted(path):
    tensors = [torch.randn(3, 5)]
    buf = torch.cat([PACKERS[path](tensors), torch.full((64,), 0xAB, dtype=torch.uint8)])
    assert _same(UNPACKERS[path](buf)[0], tensors[0])


@pytest.mark.parametrize("path", PATHS)
def test_pack_does_not_track_grad(path):
    w = torch.randn(4, 4, requires_grad=True)
    buf = PACKERS[path]([w, w.t() * 2])
    assert not buf.requires_grad
    assert _same(UNPACKERS[path](buf)[1], (w.t() * 2).detach())


# ---- malformed headers --------------------------------------------------------------------------
def _sample_buffer():
    return comm._torch_pack([torch.randn(4, 3), torch.arange(5, dtype=torch.int64),
                             torch.randn(2).to(torch.bfloat16)])


def _patch(buf, offset, fmt, *values):
    raw = bytearray(buf.numpy().tobytes())
    struct.pack_into(fmt, raw, offset, *values)
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


E0, E1 = 24, 24 + 24 + 16  # first and second entry
_OFF0 = struct.unpack_from("<Q", _sample_buffer().numpy(), E0 + 8)[0]
_TOTAL = _sample_buffer().numel()

MALFORMED = {
    "truncated_fixed": (lambda b: b[:10], "truncated: 10 bytes is shorter"),
    "truncated_data": (lambda b: b[:-16], "truncated: header declares"),
    "truncated_empty": (lambda b: b[:0], "truncated: 0 bytes"),
    "bad_magic": (lambda b: _patch(b, 0, "<I", 0xDEADBEEF), "bad magic 0xdeadbeef"),
    "bad_version": (lambda b: _patch(b, 4, "<H", 7), "unsupported version 7"),
    "reserved": (lambda b: _patch(b, 6, "<H", 1), "reserved field"),
    "header_bytes_small": (lambda b: _patch(b, 12, "<I", 3), "header_bytes 3 out of range"),
    "header_bytes_large": (lambda b: _patch(b, 12, "<I", 10 ** 6), "out of range"),
    "count_too_large": (lambda b: _patch(b, 8, "<I", 0xFFFFFFFF), "does not fit"),
    "count_too_small": (lambda b: _patch(b, 8, "<I", 2), "does not match the"),
    "unknown_dtype": (lambda b: _patch(b, E1, "<B", 200), "entry 1: unknown dtype code 200"),
    "zero_dtype": (lambda b: _patch(b, E0, "<B", 0), "entry 0: unknown dtype code 0"),
    "ndim_huge": (lambda b: _patch(b, E0 + 1, "<B", 255), "ndim 255 exceeds 64"),
    "ndim_past_header": (lambda b: _patch(b, E0 + 1, "<B", 60), "shape extends past"),
    "entry_reserved": (lambda b: _patch(b, E0 + 4, "<I", 1), "reserved bytes are not zero"),
    "negative_dim": (lambda b: _patch(b, E0 + 24, "<q", -4), "negative dimension -4"),
    "length_mismatch": (lambda b: _patch(b, E0 + 16, "<Q", 52), "byte length 52 does not match"),
    "shape_mismatch": (lambda b: _patch(b, E0 + 24, "<q", 5), "does not match shape [5, 3]"),
    "huge_shape": (lambda b: _patch(b, E0 + 24, "<qq", 2 ** 62, 2 ** 62), "does not match"),
    "offset_out_of_range": (lambda b: _patch(b, E1 + 8, "<Q", _TOTAL + 16), "out of range"),
    "offset_wraps": (lambda b: _patch(b, E1 + 8, "<Q", 2 ** 64 - 16), "out of range"),
    "offset_unaligned": (lambda b: _patch(b, E0 + 8, "<Q", _OFF0 + 4), "not 16-byte aligned"),
    "offset_overlap": (lambda b: _patch(b, E0 + 8, "<Q", 16), "overlaps the header"),
    "total_mismatch": (lambda b: _patch(torch.cat([b, torch.zeros(16, dtype=torch.uint8)]), 16,
                                        "<Q", _TOTAL + 16), f"total_bytes {_TOTAL + 16} does not"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_header_rejected(path, case):
    mutate, fragment = MALFORMED[case]
    bad = mutate(_sample_buffer())
    with pytest.raises(ValueError, match="malformed packed buffer") as err:
        UNPACKERS[path](bad)
    assert fragment in str(err.value)
    with pytest.raises(ValueError, match="malformed packed buffer"):
        ACCUMULATORS[path]([torch.zeros(4, 3), torch.zeros(5), torch.zeros(2)], bad, 1.0)


@needs_ext
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_messages_identical(case):
    bad = MALFORMED[case][0](_sample_buffer())
    msgs = []
    for fn in (comm._C.unpack, comm._torch_unpack):
        with pytest.raises(ValueError) as err:
            fn(bad)
        msgs.append(str(err.value))
    assert msgs[0] == msgs[1]


@needs_ext
def test_fuzzed_headers_agree():
    """Random byte corruptions of the header: both paths accept (with equal results) or both
    reject with the same message; neither reads out of bounds."""
    base = _sample_buffer()
    span = _OFF0 + 16  # the header, its padding and some data (corrupt data still unpacks)
    gen = torch.Generator().manual_seed(0)
    outcomes = set()
    for _ in range(400):
        raw = base.clone()
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            pos = int(torch.randint(span, (1,), generator=gen))
            raw[pos] = int(torch.randint(256, (1,), generator=gen))
        cut = int(torch.randint(raw.numel() + 1, (1,), generator=gen))
        if int(torch.randint(4, (1,), generator=gen)) == 0:
            raw = raw[:cut]
        res = []
        for fn in (comm._C.unpack, comm._torch_unpack):
            try:
                res.append(("ok", fn(raw)))
            except ValueError as exc:
                res.append(("err", str(exc)))
        assert res[0][0] == res[1][0], (res[0], res[1])
        if res[0][0] == "err":
            assert res[0][1] == res[1][1]
        else:
            assert all(_same(a, b) for a, b in zip(res[0][1], res[1][1]))
        outcomes.add(res[0][0])
    assert outcomes == {"ok", "err"}


@pytest.mark.parametrize("path", PATHS)
def test_bad_buffer_argument(path):
    for bad in (torch.zeros(64, dtype=torch.int32), torch.zeros(4, 16, dtype=torch.uint8),
                torch.zeros(64, dtype=torch.uint8)[::2]):
        with pytest.raises(ValueError, match="1-D contiguous uint8"):
            UNPACKERS[path](bad)


@pytest.mark.parametrize("path", PATHS)
def test_pack_rejects_unsupported(path):
    with pytest.raises(ValueError, match="tensor 1 has an unsupported dtype"):
        PACKERS[path]([torch.zeros(2), torch.zeros(2, dtype=torch.complex64)])
    with pytest.raises(ValueError, match="tensor 0 is not a dense"):
        PACKERS[path]([torch.eye(3).to_sparse()])


# ---- scale_accumulate ---------------------------------------------------------------------------
def test_madd_mode_probe_matches_torch():
    mode = comm._madd_mode(torch.device("cpu"))
    assert mode in (0, 1, 2)
    a = 1.0 + 2.0 ** -12
    d = torch.full((33,), -1.0)
    d.add_(torch.full((33,), a), alpha=a)
    expect = {1: 2.0 ** -11 + 2.0 ** -24, 0: 2.0 ** -11}.get(mode)
    if expect is not None:
        assert set(d.tolist()) == {expect}


def _acc_case(seed, src_dtypes=FLOATS + (torch.float64,)):
    gen = torch.Generator().manual_seed(seed)
    srcs = _random_tensors(seed, dtypes=src_dtypes)
    srcs.append((torch.randn(70001, generator=gen) * 1e3).to(torch.bfloat16))  # threaded chunks
    dst = [torch.randn(s.shape, generator=gen) for s in srcs]
    return srcs, dst


SCALES = (0.37, 1.0 / 3.0, -2.5e-3, 1.0, 1.0 / 7.0, 0.0, -1e30)


@needs_ext
@pytest.mark.parametrize("variant", ["auto", "generic"])
@pytest.mark.parametrize("seed", range(8))
def test_scale_accumulate_bit_identical(seed, variant):
    srcs, dst = _acc_case(seed)
    buf = comm._torch_pack(srcs)
    scale = SCALES[seed % len(SCALES)]
    ref = [d.clone() for d in dst]
    comm._torch_scale_accumulate(ref, buf, scale)
    comm._C._set_cpu_variant(variant)
    try:
        out = [d.clone() for d in dst]
        comm.scale_accumulate(out, buf, scale)
        out2 = [d.clone() for d in dst]  # twice in a row: accumulation really adds
        comm.scale_accumulate(out2, buf, scale)
        comm.scale_accumulate(out2, buf, scale)
    finally:
        comm._C._set_cpu_variant("auto")
    ref2 = [d.clone() for d in ref]
    comm._torch_scale_accumulate(ref2, buf, scale)
    for a, b in zip(out, ref):
        assert torch.equal(_bits(a), _bits(b))
    for a, b in zip(out2, ref2):
        assert torch.equal(_bits(a), _bits(b))


@needs_ext
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_scale_accumulate_modes_match_their_arithmetic(mode):
    """mode 1 is one rounding (fma), mode 0 two roundings, mode 2 torch itself."""
    gen = torch.Generator().manual_seed(mode)
    src = torch.randn(1000, generator=gen) * 1e3
    dst = torch.randn(1000, generator=gen)
    scale = 0.37
    out = dst.clone()
    comm._C.scale_accumulate([out], comm._C.pack([src]), scale, mode)
    exact = dst.double() + torch.tensor(scale, dtype=torch.float32).double() * src.double()
    if mode == 0:
        prod = (torch.tensor(scale, dtype=torch.float32) * src)
        assert torch.equal(_bits(out), _bits(dst + prod))
    elif mode == 1:  # one rounding: |out - exact| <= half an ulp of out, never worse than mode 0
        err = (out.double() - exact).abs()
        two = (dst + torch.tensor(scale, dtype=torch.float32) * src).double()
        assert bool((err <= (two - exact).abs()).all())
    else:
        assert torch.equal(_bits(out), _bits(dst.clone().add_(src, alpha=scale)))


@pytest.mark.parametrize("path", PATHS)
def test_scale_accumulate_delegated_destinations(path):
    """Non-contiguous and bf16 destinations, integer sources: the same as the torch op."""
    src = [torch.randn(6, 5), torch.randint(-9, 9, (7,)), torch.randn(4, 4).to(torch.float16)]
    buf = comm._torch_pack(src)
    base = torch.randn(5, 6)
    dst = [base.t(), torch.randn(7).to(torch.bfloat16), torch.randn(4, 4).double()]
    expect = [d.clone().add_(s.float(), alpha=0.3) for d, s in zip(dst, src)]
    ACCUMULATORS[path](dst, buf, 0.3)
    for a, b in zip(dst, expect):
        assert _same(a, b)
    assert torch.equal(base, dst[0].t())  # the transposed view wrote into its base


@pytest.mark.parametrize("path", PATHS)
def test_scale_accumulate_argument_errors(path):
    buf = comm._torch_pack([torch.randn(4, 3), torch.randn(5)])
    cases = [
        ([torch.zeros(4, 3)], 1.0, "1 destination tensors for a packed buffer of 2"),
        ([torch.zeros(3, 4), torch.zeros(5)], 1.0, "destination 0 has shape [3, 4] but the "
                                                   "packed tensor has shape [4, 3]"),
        ([torch.zeros(4, 3), torch.zeros(5, dtype=torch.int64)], 1.0,
         "destination 1 is not a floating-point tensor"),
        ([torch.zeros(4, 3), torch.zeros(5)], 1e39, "exceeds the float32 range"),
    ]
    for dst, scale, fragment in cases:
        before = [d.clone() for d in dst]
        with pytest.raises(ValueError) as err:
            ACCUMULATORS[path](dst, buf, scale)
        assert fragment in str(err.value)
        assert all(torch.equal(a, b) for a, b in zip(dst, before))  # nothing was written


@pytest.mark.parametrize("path", PATHS)
def test_scale_accumulate_into_leaf_parameters(path):
    p = torch.zeros(3, requires_grad=True)  # in-place on a leaf: allowed here (no autograd)
    ACCUMULATORS[path]([p], comm._torch_pack([torch.ones(3)]), 2.0)
    assert p.tolist() == [2.0, 2.0, 2.0] and p.grad_fn is None


# ---- selection by environment -------------------------------------------------------------------
def _run(code, **env):
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = str(ROOT) + os.pathsep + full.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_no_ext_env_selects_torch_and_logs_once():
    code = ("import logging, torch; logging.basicConfig(level=logging.INFO);"
            "from chameleon_ext.comm import packed as comm; b = comm.pack([torch.ones(2)]); comm.unpack(b);"
            "comm.scale_accumulate([torch.zeros(2)], b); print(comm.backend())")
    res = _run(code, CHAMELEON_NO_EXT="1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "torch"
    lines = [ln for ln in res.stderr.splitlines() if "packed comm backend" in ln]
    assert len(lines) == 1 and "CHAMELEON_NO_EXT=1" in lines[0]


@needs_ext
def test_bit_identical_without_vector_fma():
    """With torch's DEFAULT CPU kernels (multiply, round, add) the probe switches the extension
    to two roundings, and the paths still agree bit for bit."""
    code = ("import torch; from chameleon_ext.comm import packed as comm;"
            "g = torch.Generator().manual_seed(3);"
            "s = [torch.randn(1003, generator=g) * 1e3, torch.randn(77, generator=g).half()];"
            "d = [torch.randn(1003, generator=g), torch.randn(77, generator=g)];"
            "b = comm.pack(s); r = [x.clone() for x in d]; o = [x.clone() for x in d];"
            "comm._torch_scale_accumulate(r, b, 0.37); comm.scale_accumulate(o, b, 0.37);"
            "print(comm.backend(), comm._madd_mode(torch.device('cpu')),"
            " all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(o, r)))")
    res = _run(code, ATEN_CPU_CAPABILITY="default")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [comm.backend(), "0", "True"]


# ---- CUDA (skipped without a GPU) ---------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@needs_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seed", range(4))
def test_cuda_pack_bytes_equal_cpu_bytes(path, seed):
    tensors = _random_tensors(seed)
    cpu = comm._torch_pack(tensors)
    gpu = PACKERS[path]([t.cuda() for t in tensors])
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
    for a, b in zip(UNPACKERS[path](gpu), tensors):
        assert a.is_cuda and _same(a.cpu(), b)


@needs_cuda
@pytest.mark.parametrize("path", PATHS)
def test_cuda_malformed_rejected(path):
    for case in ("bad_magic", "truncated_data", "offset_out_of_range", "unknown_dtype"):
        mutate, fragment = MALFORMED[case]
        with pytest.raises(ValueError, match="malformed packed buffer") as err:
            UNPACKERS[path](mutate(_sample_buffer()).cuda())
        assert fragment in str(err.value)


@needs_cuda
@needs_ext
@pytest.mark.parametrize("seed", range(4))
def test_cuda_scale_accumulate_bit_identical(seed):
    srcs, dst = _acc_case(seed)
    buf = comm._torch_pack(srcs).cuda()
    dst = [d.cuda() for d in dst]
    ref, out = [d.clone() for d in dst], [d.clone() for d in dst]
    comm._torch_scale_accumulate(ref, buf, SCALES[seed % len(SCALES)])
    comm.scale_accumulate(out, buf, SCALES[seed % len(SCALES)])
    for a, b in zip(out, ref):
        assert torch.equal(_bits(a), _bits(b))

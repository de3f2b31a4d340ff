// chameleon_ext.comm._C: fused kernels for rerouted communication.
//
//   pack(tensors)                      -> one uint8 buffer: header + 16-byte aligned data
//   unpack(buffer, copy=False)         -> list of tensors (views into buffer unless copy)
//   scale_accumulate(dst, buffer, scale, mode) : dst[i] += scale * tensor_i, in float32
//
// The pure-torch twin of every function lives in chameleon_ext/comm/packed.py and produces the same
// bytes, the same values (bit for bit) and the same error messages; tests/unit/test_comm.py
// holds the two to that. The header layout is documented in chameleon_ext/comm/packed.py and below.
//
// Header (little-endian), then the data of each tensor at its offset (multiple of 16), zero
// padding between the end of one tensor's bytes and the next 16-byte boundary:
//   0  u32 magic 0x4B504843 ("CHPK")   4 u16 version (1)   6 u16 reserved (0)
//   8  u32 count                        12 u32 header_bytes (24 + sum of entry sizes)
//   16 u64 total_bytes (whole buffer, multiple of 16)
//   24 count entries of 24 + 8*ndim bytes each:
//      0 u8 dtype code   1 u8 ndim   2 u16 reserved (0)   4 u32 reserved (0)
//      8 u64 byte offset (from the buffer start)   16 u64 byte length   24 i64 shape[ndim]
#include <torch/extension.h>

#include <c10/util/Half.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#ifdef CHAMELEON_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "comm_cuda.h"
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "chameleon_ext.comm._C assumes a little-endian host"
#endif

// ---------------------------------------------------------------------------------------------
// CPU inner loops: an AVX2/FMA/F16C variant (x86-64 with GCC or clang) and a baseline variant,
// chosen once at run time.
namespace ch_generic {
#include "cpu_kernels.inc"
}  // namespace ch_generic

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
#define CH_HAVE_AVX2_VARIANT 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define CH_VARIANT_AVX2 1
namespace ch_avx2 {
#include "cpu_kernels.inc"
}  // namespace ch_avx2
#undef CH_VARIANT_AVX2
#pragma GCC pop_options
#elif (defined(__x86_64__) || defined(_M_X64)) && defined(__clang__)
#define CH_HAVE_AVX2_VARIANT 1
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#define CH_VARIANT_AVX2 1
namespace ch_avx2 {
#include "cpu_kernels.inc"
}  // namespace ch_avx2
#undef CH_VARIANT_AVX2
#pragma clang attribute pop
#endif

namespace chameleon {
namespace {

constexpr uint32_t kMagic = 0x4B504843u;  // bytes 'C' 'H' 'P' 'K'
constexpr uint16_t kVersion = 1;
constexpr uint64_t kFixedHeader = 24;
constexpr uint64_t kEntryFixed = 24;
constexpr uint64_t kAlign = 16;
constexpr int64_t kMaxNdim = 64;
constexpr const char* kBad = "malformed packed buffer: ";

// ---- dtype codes -------------------------------------------------------------------------------
int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 1;
    case at::kHalf: return 2;
    case at::kBFloat16: return 3;
    case at::kDouble: return 4;
    case at::kLong: return 5;
    case at::kInt: return 6;
    case at::kShort: return 7;
    case at::kChar: return 8;
    case at::kByte: return 9;
    case at::kBool: return 10;
    default: return 0;
  }
}

bool code_dtype(uint32_t code, at::ScalarType* out) {
  static const at::ScalarType table[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble,
                                         at::kLong,  at::kInt,  at::kShort,    at::kChar,
                                         at::kByte,  at::kBool};
  if (code < 1 || code > 10) return false;
  *out = table[code - 1];
  return true;
}

constexpr const char* kSupported =
    "float32, float16, bfloat16, float64, int64, int32, int16, int8, uint8, bool";

// ---- small helpers -----------------------------------------------------------------------------
inline uint64_t align_up(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

template <typename T>
inline T get_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
inline void put_le(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string shape_str(at::IntArrayRef shape) { return shape_str(shape.vec()); }

// ---- header parsing ----------------------------------------------------------------------------
struct Entry {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t offset;
  uint64_t nbytes;
};

struct Header {
  uint32_t count = 0;
  uint64_t header_bytes = 0;
  uint64_t total_bytes = 0;
  std::vector<Entry> entries;
};

// Validates the 24-byte fixed header against the buffer length. `p` holds min(len, 24) bytes.
Header parse_fixed(const uint8_t* p, uint64_t len) {
  TORCH_CHECK_VALUE(len >= kFixedHeader, kBad, "truncated: ", len,
                    " bytes is shorter than the 24-byte fixed header");
  const uint32_t magic = get_le<uint32_t>(p);
  if (magic != kMagic) {
    char buf[96];
    std::snprintf(buf, sizeof(buf), "bad magic 0x%08x (expected 0x4b504843, 'CHPK')", magic);
    TORCH_CHECK_VALUE(false, kBad, buf);
  }
  const uint16_t version = get_le<uint16_t>(p + 4);
  TORCH_CHECK_VALUE(version == kVersion, kBad, "unsupported version ", version,
                    " (this build reads version 1)");
  const uint16_t reserved = get_le<uint16_t>(p + 6);
  TORCH_CHECK_VALUE(reserved == 0, kBad, "reserved field of the fixed header is ", reserved,
                    ", expected 0");
  Header h;
  h.count = get_le<uint32_t>(p + 8);
  h.header_bytes = get_le<uint32_t>(p + 12);
  h.total_bytes = get_le<uint64_t>(p + 16);
  TORCH_CHECK_VALUE(h.total_bytes <= len, kBad, "truncated: header declares ", h.total_bytes,
                    " bytes but the buffer has ", len);
  TORCH_CHECK_VALUE(h.header_bytes >= kFixedHeader && h.header_bytes <= h.total_bytes, kBad,
                    "header_bytes ", h.header_bytes, " out of range [24, ", h.total_bytes, "]");
  TORCH_CHECK_VALUE(h.count <= (h.header_bytes - kFixedHeader) / kEntryFixed, kBad, "count ",
                    h.count, " does not fit in header_bytes ", h.header_bytes);
  return h;
}

// Validates the entries. `p` holds the first h.header_bytes bytes of the buffer; nothing past
// them is read. After this, every tensor's bytes lie inside [0, total_bytes) <= buffer length.
void parse_entries(const uint8_t* p, Header& h) {
  const uint64_t hb = h.header_bytes;
  uint64_t cursor = kFixedHeader;
  uint64_t prev_end = align_up(hb);
  h.entries.clear();
  h.entries.reserve(h.count);
  for (uint32_t i = 0; i < h.count; ++i) {
    TORCH_CHECK_VALUE(cursor + kEntryFixed <= hb, kBad, "entry ", i,
                      " extends past header_bytes ", hb);
    const uint8_t* e = p + cursor;
    const uint32_t code = e[0];
    const int64_t ndim = e[1];
    Entry ent;
    TORCH_CHECK_VALUE(code_dtype(code, &ent.dtype), kBad, "entry ", i, ": unknown dtype code ",
                      code);
    TORCH_CHECK_VALUE(ndim <= kMaxNdim, kBad, "entry ", i, ": ndim ", ndim, " exceeds 64");
    TORCH_CHECK_VALUE(get_le<uint16_t>(e + 2) == 0 && get_le<uint32_t>(e + 4) == 0, kBad,
                      "entry ", i, ": reserved bytes are not zero");
    TORCH_CHECK_VALUE(cursor + kEntryFixed + 8 * static_cast<uint64_t>(ndim) <= hb, kBad,
                      "entry ", i, ": shape extends past header_bytes ", hb);
    ent.offset = get_le<uint64_t>(e + 8);
    ent.nbytes = get_le<uint64_t>(e + 16);
    ent.shape.resize(ndim);
    bool any_zero = false;
    for (int64_t k = 0; k < ndim; ++k) {
      ent.shape[k] = get_le<int64_t>(e + kEntryFixed + 8 * k);
      any_zero = any_zero || ent.shape[k] == 0;
    }
    for (int64_t k = 0; k < ndim; ++k) {
      TORCH_CHECK_VALUE(ent.shape[k] >= 0, kBad, "entry ", i, ": negative dimension ",
                        ent.shape[k], " in shape ", shape_str(ent.shape));
    }
    const uint64_t itemsize = c10::elementSize(ent.dtype);
    uint64_t expect = 0;
    bool overflow = false;
    if (!any_zero) {
      expect = itemsize;
      for (int64_t k = 0; k < ndim && !overflow; ++k) {
        overflow = __builtin_mul_overflow(expect, static_cast<uint64_t>(ent.shape[k]), &expect);
      }
    }
    TORCH_CHECK_VALUE(!overflow && expect == ent.nbytes, kBad, "entry ", i, ": byte length ",
                      ent.nbytes, " does not match shape ", shape_str(ent.shape), " x itemsize ",
                      itemsize);
    TORCH_CHECK_VALUE(ent.offset % kAlign == 0, kBad, "entry ", i, ": offset ", ent.offset,
                      " is not 16-byte aligned");
    TORCH_CHECK_VALUE(ent.offset >= prev_end, kBad, "entry ", i, ": offset ", ent.offset,
                      " overlaps the header or the previous tensor (data may start at ",
                      prev_end, ")");
    TORCH_CHECK_VALUE(ent.offset <= h.total_bytes && ent.nbytes <= h.total_bytes - ent.offset,
                      kBad, "entry ", i, ": bytes [", ent.offset, ", ", ent.offset, "+",
                      ent.nbytes, ") out of range of the ", h.total_bytes, "-byte buffer");
    prev_end = ent.offset + ent.nbytes;
    cursor += kEntryFixed + 8 * static_cast<uint64_t>(ndim);
    h.entries.push_back(std::move(ent));
  }
  TORCH_CHECK_VALUE(cursor == hb, kBad, "header_bytes ", hb, " does not match the ", cursor,
                    " bytes of the ", h.count, " entries");
  const uint64_t expect_total = align_up(prev_end);
  TORCH_CHECK_VALUE(h.total_bytes == expect_total, kBad, "total_bytes ", h.total_bytes,
                    " does not match the ", expect_total, " bytes implied by the entries");
}

void check_buffer(const at::Tensor& buffer) {
  TORCH_CHECK_VALUE(buffer.layout() == at::kStrided && buffer.scalar_type() == at::kByte &&
                        buffer.dim() == 1 && buffer.is_contiguous(),
                    "packed buffer must be a 1-D contiguous uint8 tensor");
}

// Reads and validates the header; for a buffer off the CPU only the header bytes are copied to
// the host (synchronously).
Header read_header(const at::Tensor& buffer) {
  check_buffer(buffer);
  const uint64_t len = static_cast<uint64_t>(buffer.numel());
  if (buffer.is_cpu()) {
    const uint8_t* p = buffer.data_ptr<uint8_t>();
    Header h = parse_fixed(p, len);
    parse_entries(p, h);
    return h;
  }
  const int64_t nfixed = static_cast<int64_t>(std::min<uint64_t>(len, kFixedHeader));
  at::Tensor fixed = buffer.narrow(0, 0, nfixed).to(at::kCPU).contiguous();
  Header h = parse_fixed(fixed.data_ptr<uint8_t>(), len);
  at::Tensor full =
      buffer.narrow(0, 0, static_cast<int64_t>(h.header_bytes)).to(at::kCPU).contiguous();
  parse_entries(full.data_ptr<uint8_t>(), h);
  return h;
}

// ---- CPU variant selection ---------------------------------------------------------------------
bool cpu_has_avx2() {
#ifdef CH_HAVE_AVX2_VARIANT
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

std::atomic<int> g_cpu_variant{-1};  // -1 auto, 0 generic, 1 avx2

bool use_avx2() {
  const int v = g_cpu_variant.load(std::memory_order_relaxed);
  if (v < 0) return cpu_has_avx2();
  return v == 1;
}

void acc_cpu(float* d, const void* s, int kind, int mode, float a, int64_t n) {
#ifdef CH_HAVE_AVX2_VARIANT
  if (use_avx2()) return ch_avx2::acc_dispatch(d, s, kind, mode, a, n);
#endif
  ch_generic::acc_dispatch(d, s, kind, mode, a, n);
}

std::string cpu_variant() { return use_avx2() ? "avx2" : "generic"; }

void set_cpu_variant(const std::string& name) {
  if (name == "auto") {
    g_cpu_variant = -1;
  } else if (name == "generic") {
    g_cpu_variant = 0;
  } else if (name == "avx2") {
    TORCH_CHECK_VALUE(cpu_has_avx2(), "this CPU (or build) has no AVX2/FMA/F16C variant");
    g_cpu_variant = 1;
  } else {
    TORCH_CHECK_VALUE(false, "cpu variant must be 'auto', 'generic' or 'avx2', got '", name, "'");
  }
}

// ---- pack --------------------------------------------------------------------------------------
at::Tensor pack(std::vector<at::Tensor> tensors) {
  at::NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK_VALUE(n <= static_cast<int64_t>(std::numeric_limits<uint32_t>::max()),
                    "pack: too many tensors (", n, ")");
  const at::Device device = n ? tensors[0].device() : at::Device(at::kCPU);
  std::vector<int> codes(n);
  std::vector<uint64_t> nbytes(n), offsets(n);
  uint64_t header_bytes = kFixedHeader;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.defined(), "pack: tensor ", i, " is undefined");
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, "pack: tensor ", i,
                      " is not a dense (strided) tensor");
    TORCH_CHECK_VALUE(t.device() == device, "pack: tensor ", i, " is on ", t.device().str(),
                      " but tensor 0 is on ", device.str());
    codes[i] = dtype_code(t.scalar_type());
    TORCH_CHECK_VALUE(codes[i] != 0, "pack: tensor ", i, " has an unsupported dtype (supported: ",
                      kSupported, ")");
    TORCH_CHECK_VALUE(t.dim() <= kMaxNdim, "pack: tensor ", i, " has ", t.dim(),
                      " dimensions, more than 64");
    nbytes[i] = static_cast<uint64_t>(t.numel()) * t.element_size();
    header_bytes += kEntryFixed + 8 * static_cast<uint64_t>(t.dim());
  }
  TORCH_CHECK_VALUE(header_bytes <= std::numeric_limits<uint32_t>::max(),
                    "pack: header too large");
  const uint64_t data_start = align_up(header_bytes);
  uint64_t cursor = data_start;
  for (int64_t i = 0; i < n; ++i) {
    offsets[i] = cursor;
    cursor = align_up(cursor + nbytes[i]);
  }
  const uint64_t total = cursor;

  // Host copy of the header plus its padding up to data_start.
  at::Tensor header_t = at::zeros({static_cast<int64_t>(data_start)}, at::kByte);
  uint8_t* hp = header_t.data_ptr<uint8_t>();
  put_le<uint32_t>(hp, kMagic);
  put_le<uint16_t>(hp + 4, kVersion);
  put_le<uint16_t>(hp + 6, 0);
  put_le<uint32_t>(hp + 8, static_cast<uint32_t>(n));
  put_le<uint32_t>(hp + 12, static_cast<uint32_t>(header_bytes));
  put_le<uint64_t>(hp + 16, total);
  uint64_t ec = kFixedHeader;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    uint8_t* e = hp + ec;
    e[0] = static_cast<uint8_t>(codes[i]);
    e[1] = static_cast<uint8_t>(t.dim());
    put_le<uint64_t>(e + 8, offsets[i]);
    put_le<uint64_t>(e + 16, nbytes[i]);
    for (int64_t k = 0; k < t.dim(); ++k) put_le<int64_t>(e + kEntryFixed + 8 * k, t.size(k));
    ec += kEntryFixed + 8 * static_cast<uint64_t>(t.dim());
  }

  at::Tensor buf = at::empty({static_cast<int64_t>(total)},
                             at::TensorOptions().dtype(at::kByte).device(device));

  // Tensors whose raw memory is not their row-major bytes are copied by torch (copy_ handles any
  // strides and lazy neg/conj bits); the others by the fused copy below.
  auto raw_ok = [](const at::Tensor& t) {
    return t.is_contiguous() && !t.is_neg() && !t.is_conj();
  };
  auto view_of = [&](int64_t i) {
    return buf.narrow(0, static_cast<int64_t>(offsets[i]), static_cast<int64_t>(nbytes[i]))
        .view(tensors[i].scalar_type())
        .view(tensors[i].sizes());
  };

  if (device.is_cpu()) {
    uint8_t* bp = buf.data_ptr<uint8_t>();
    std::memcpy(bp, hp, data_start);
    struct Job {
      const uint8_t* src;
      uint8_t* dst;
      uint64_t n;
    };
    constexpr uint64_t kChunk = 256 * 1024;
    std::vector<Job> jobs;
    uint64_t copy_bytes = 0;
    for (int64_t i = 0; i < n; ++i) {
      uint8_t* dst = bp + offsets[i];
      const uint64_t end = offsets[i] + nbytes[i];
      std::memset(bp + end, 0, align_up(end) - end);
      if (nbytes[i] == 0 || !raw_ok(tensors[i])) continue;
      const uint8_t* src = static_cast<const uint8_t*>(tensors[i].const_data_ptr());
      for (uint64_t off = 0; off < nbytes[i]; off += kChunk) {
        jobs.push_back({src + off, dst + off, std::min(kChunk, nbytes[i] - off)});
      }
      copy_bytes += nbytes[i];
    }
    const int64_t njobs = static_cast<int64_t>(jobs.size());
    auto run = [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) std::memcpy(jobs[j].dst, jobs[j].src, jobs[j].n);
    };
    if (copy_bytes >= (1u << 20) && njobs > 1) {
      at::parallel_for(0, njobs, 1, run);
    } else {
      run(0, njobs);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (nbytes[i] != 0 && !raw_ok(tensors[i])) view_of(i).copy_(tensors[i]);
    }
    return buf;
  }

#ifdef CHAMELEON_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    // Header: from pinned host memory; the caching host allocator keeps it alive until the
    // asynchronous copy has run.
    buf.narrow(0, 0, static_cast<int64_t>(data_start)).copy_(header_t.pin_memory(), true);
    std::vector<cuda::CopyDesc> descs;
    descs.reserve(n);
    uint8_t* bp = buf.data_ptr<uint8_t>();
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t end = offsets[i] + nbytes[i];
      if (nbytes[i] != 0 && raw_ok(tensors[i])) {
        // Data and its padding, both by the kernel.
        descs.push_back({static_cast<const uint8_t*>(tensors[i].const_data_ptr()),
                         bp + offsets[i], nbytes[i], align_up(end) - offsets[i]});
      } else {
        // Data (if any) by torch below; only the padding by the kernel, so writes never overlap.
        descs.push_back({nullptr, bp + end, 0, align_up(end) - end});
      }
    }
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    const cudaError_t err = cuda::launch_pack_copy(descs.data(), n, stream);
    TORCH_CHECK(err == cudaSuccess, "pack: CUDA launch failed: ", cudaGetErrorString(err));
    for (int64_t i = 0; i < n; ++i) {
      if (nbytes[i] != 0 && !raw_ok(tensors[i])) view_of(i).copy_(tensors[i]);
    }
    return buf;
  }
#endif

  // Any other device: torch ops only (same bytes).
  buf.narrow(0, 0, static_cast<int64_t>(data_start)).copy_(header_t);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t end = offsets[i] + nbytes[i];
    const uint64_t pad = align_up(end) - end;
    if (pad) buf.narrow(0, static_cast<int64_t>(end), static_cast<int64_t>(pad)).zero_();
    if (nbytes[i]) view_of(i).copy_(tensors[i]);
  }
  return buf;
}

// ---- unpack ------------------------------------------------------------------------------------
at::Tensor aligned_base(const at::Tensor& buffer) {
  const bool aligned = reinterpret_cast<uintptr_t>(buffer.const_data_ptr()) % kAlign == 0 &&
                       buffer.storage_offset() % static_cast<int64_t>(kAlign) == 0;
  return aligned ? buffer : buffer.clone();
}

std::vector<at::Tensor> views_of(const at::Tensor& base, const Header& h) {
  std::vector<at::Tensor> out;
  out.reserve(h.entries.size());
  for (const Entry& e : h.entries) {
    out.push_back(base.narrow(0, static_cast<int64_t>(e.offset), static_cast<int64_t>(e.nbytes))
                      .view(e.dtype)
                      .view(e.shape));
  }
  return out;
}

std::vector<at::Tensor> unpack(const at::Tensor& buffer, bool copy) {
  at::NoGradGuard no_grad;
  const Header h = read_header(buffer);
  std::vector<at::Tensor> out = views_of(aligned_base(buffer), h);
  if (copy) {
    for (auto& t : out) t = t.clone();
  }
  return out;
}

// ---- scale_accumulate --------------------------------------------------------------------------
int src_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    case at::kDouble: return 3;
    default: return -1;
  }
}

void scale_accumulate(std::vector<at::Tensor> dst, const at::Tensor& buffer, double scale,
                      int64_t mode) {
  at::NoGradGuard no_grad;
  TORCH_CHECK_VALUE(mode >= 0 && mode <= 2, "scale_accumulate: mode must be 0, 1 or 2");
  TORCH_CHECK_VALUE(!(std::isfinite(scale) &&
                      std::fabs(scale) > static_cast<double>(std::numeric_limits<float>::max())),
                    "scale_accumulate: |scale| exceeds the float32 range");
  const Header h = read_header(buffer);
  const int64_t n = static_cast<int64_t>(dst.size());
  TORCH_CHECK_VALUE(n == static_cast<int64_t>(h.count), "scale_accumulate: ", n,
                    " destination tensors for a packed buffer of ", h.count, " tensors");
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& d = dst[i];
    TORCH_CHECK_VALUE(d.defined() && d.layout() == at::kStrided, "scale_accumulate: destination ",
                      i, " is not a dense (strided) tensor");
    TORCH_CHECK_VALUE(d.device() == buffer.device(), "scale_accumulate: destination ", i,
                      " is on ", d.device().str(), " but the packed buffer is on ",
                      buffer.device().str());
    TORCH_CHECK_VALUE(at::isFloatingType(d.scalar_type()), "scale_accumulate: destination ", i,
                      " is not a floating-point tensor");
    TORCH_CHECK_VALUE(d.sizes().vec() == h.entries[i].shape, "scale_accumulate: destination ", i,
                      " has shape ", shape_str(d.sizes()), " but the packed tensor has shape ",
                      shape_str(h.entries[i].shape));
  }
  const at::Tensor base = aligned_base(buffer);
  const uint8_t* bp = static_cast<const uint8_t*>(base.const_data_ptr());
  const float a = static_cast<float>(scale);

  // Entries that the fused loops do not cover run as torch ops: exactly the fallback's
  // dst.add_(src.float(), alpha=scale).
  auto fused_ok = [&](int64_t i) {
    const at::Tensor& d = dst[i];
    return mode != 2 && d.scalar_type() == at::kFloat && d.is_contiguous() && !d.is_neg() &&
           src_kind(h.entries[i].dtype) >= 0;
  };
  auto torch_path = [&](int64_t i) {
    const Entry& e = h.entries[i];
    at::Tensor s = base.narrow(0, static_cast<int64_t>(e.offset), static_cast<int64_t>(e.nbytes))
                       .view(e.dtype)
                       .view(e.shape);
    dst[i].add_(s.to(at::kFloat), scale);
  };

  if (buffer.is_cpu()) {
    struct Job {
      float* d;
      const uint8_t* s;
      int kind;
      int64_t n;
    };
    constexpr int64_t kChunk = 16384;
    std::vector<Job> jobs;
    int64_t elems = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (!fused_ok(i)) continue;
      const Entry& e = h.entries[i];
      const int64_t numel = dst[i].numel();
      if (numel == 0) continue;
      float* d = dst[i].data_ptr<float>();
      const uint8_t* s = bp + e.offset;
      const int kind = src_kind(e.dtype);
      const int64_t isz = static_cast<int64_t>(c10::elementSize(e.dtype));
      for (int64_t off = 0; off < numel; off += kChunk) {
        jobs.push_back({d + off, s + off * isz, kind, std::min(kChunk, numel - off)});
      }
      elems += numel;
    }
    const int64_t njobs = static_cast<int64_t>(jobs.size());
    auto run = [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) acc_cpu(jobs[j].d, jobs[j].s, jobs[j].kind,
                                              static_cast<int>(mode), a, jobs[j].n);
    };
    if (elems >= 65536 && njobs > 1) {
      at::parallel_for(0, njobs, 1, run);
    } else {
      run(0, njobs);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (!fused_ok(i)) torch_path(i);
    }
    return;
  }

#ifdef CHAMELEON_WITH_CUDA
  if (buffer.is_cuda()) {
    c10::cuda::CUDAGuard guard(buffer.device());
    std::vector<cuda::AccDesc> descs;
    for (int64_t i = 0; i < n; ++i) {
      if (!fused_ok(i) || dst[i].numel() == 0) continue;
      descs.push_back({dst[i].data_ptr<float>(), bp + h.entries[i].offset, dst[i].numel(),
                       src_kind(h.entries[i].dtype), 0});
    }
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(buffer.device().index()).stream();
    const cudaError_t err = cuda::launch_scale_accumulate(
        descs.data(), static_cast<int64_t>(descs.size()), a, static_cast<int>(mode), stream);
    TORCH_CHECK(err == cudaSuccess, "scale_accumulate: CUDA launch failed: ",
                cudaGetErrorString(err));
    for (int64_t i = 0; i < n; ++i) {
      if (!fused_ok(i)) torch_path(i);
    }
    return;
  }
#endif

  for (int64_t i = 0; i < n; ++i) torch_path(i);
}

bool cuda_built() {
#ifdef CHAMELEON_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace chameleon

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "chameleon_ext.comm._C: fused pack/unpack and scaled accumulate for rerouted traffic";
  m.def("pack", &chameleon::pack, py::arg("tensors"), py::call_guard<py::gil_scoped_release>(),
        "Pack tensors into one uint8 buffer (header + 16-byte aligned data).");
  m.def("unpack", &chameleon::unpack, py::arg("buffer"), py::arg("copy") = false,
        py::call_guard<py::gil_scoped_release>(),
        "Validate a packed buffer's header and return its tensors (views unless copy=True).");
  m.def("scale_accumulate", &chameleon::scale_accumulate, py::arg("dst"), py::arg("buffer"),
        py::arg("scale"), py::arg("mode"), py::call_guard<py::gil_scoped_release>(),
        "dst[i] += scale * tensor_i in float32; mode 1 fma, 0 multiply-then-add, 2 torch ops.");
  m.def("cuda_built", &chameleon::cuda_built, "Whether the CUDA kernels were compiled in.");
  m.def("format_version", []() { return static_cast<int>(chameleon::kVersion); });
  m.def("cpu_variant", &chameleon::cpu_variant, "CPU loops in use: 'avx2' or 'generic'.");
  m.def("_set_cpu_variant", &chameleon::set_cpu_variant, py::arg("name"),
        "Testing hook: force the 'generic' or 'avx2' CPU loops ('auto' restores the default).");
}

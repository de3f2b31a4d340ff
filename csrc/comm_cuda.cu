// CUDA kernels of chameleon_ext.comm._C: multi-tensor pack copy and fused scaled accumulate.
// Built only where nvcc and a CUDA build of torch exist (see setup.py). The descriptors of up to
// kMaxDescs tensors travel in the kernel's parameter block (no extra host-to-device copy); longer
// lists take several launches. blockIdx.y selects the tensor, blockIdx.x strides over its data.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "comm_cuda.h"

namespace chameleon {
namespace cuda {
namespace {

constexpr int kMaxDescs = 48;       // 48 * 32 bytes: well inside the 4 KiB parameter limit
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocksX = 1024;

struct CopyBatch {
  CopyDesc d[kMaxDescs];
};

struct AccBatch {
  AccDesc d[kMaxDescs];
};

__global__ void pack_copy_kernel(CopyBatch batch) {
  const CopyDesc desc = batch.d[blockIdx.y];
  const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  // dst and padded are 16-byte aligned by construction of the layout.
  const bool vec = (reinterpret_cast<uintptr_t>(desc.src) % 16) == 0;
  uint64_t copied = 0;
  if (vec) {
    const uint64_t nvec = desc.nbytes / 16;
    const uint4* s = reinterpret_cast<const uint4*>(desc.src);
    uint4* d = reinterpret_cast<uint4*>(desc.dst);
    for (uint64_t i = tid; i < nvec; i += stride) d[i] = s[i];
    copied = nvec * 16;
  }
  for (uint64_t i = copied + tid; i < desc.nbytes; i += stride) desc.dst[i] = desc.src[i];
  for (uint64_t i = desc.nbytes + tid; i < desc.padded; i += stride) desc.dst[i] = 0;
}

__device__ __forceinline__ float load_src(const void* src, int32_t kind, int64_t i) {
  switch (kind) {
    case kSrcF16:
      return __half2float(static_cast<const __half*>(src)[i]);
    case kSrcBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(src)[i]);
    case kSrcF64:
      return __double2float_rn(static_cast<const double*>(src)[i]);
    default:
      return static_cast<const float*>(src)[i];
  }
}

template <int Mode>
__global__ void scale_accumulate_kernel(AccBatch batch, float scale) {
  const AccDesc desc = batch.d[blockIdx.y];
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = tid; i < desc.n; i += stride) {
    const float s = load_src(desc.src, desc.kind, i);
    const float d = desc.dst[i];
    // Explicit intrinsics: the result must not depend on nvcc's --fmad setting.
    desc.dst[i] = Mode == 1 ? __fmaf_rn(scale, s, d) : __fadd_rn(d, __fmul_rn(scale, s));
  }
}

int64_t blocks_for(uint64_t work_items) {
  const int64_t b = static_cast<int64_t>((work_items + kThreads - 1) / kThreads);
  return std::max<int64_t>(1, std::min<int64_t>(b, kMaxBlocksX));
}

}  // namespace

cudaError_t launch_pack_copy(const CopyDesc* descs, int64_t n, cudaStream_t stream) {
  for (int64_t start = 0; start < n; start += kMaxDescs) {
    const int64_t count = std::min<int64_t>(kMaxDescs, n - start);
    CopyBatch batch{};
    uint64_t widest = 0;
    for (int64_t j = 0; j < count; ++j) {
      batch.d[j] = descs[start + j];
      widest = std::max<uint64_t>(widest, (descs[start + j].padded + 15) / 16);
    }
    const dim3 grid(static_cast<unsigned>(blocks_for(widest)), static_cast<unsigned>(count));
    pack_copy_kernel<<<grid, kThreads, 0, stream>>>(batch);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t launch_scale_accumulate(const AccDesc* descs, int64_t n, float scale, int mode,
                                    cudaStream_t stream) {
  for (int64_t start = 0; start < n; start += kMaxDescs) {
    const int64_t count = std::min<int64_t>(kMaxDescs, n - start);
    AccBatch batch{};
    int64_t widest = 0;
    for (int64_t j = 0; j < count; ++j) {
      batch.d[j] = descs[start + j];
      widest = std::max<int64_t>(widest, descs[start + j].n);
    }
    const dim3 grid(static_cast<unsigned>(blocks_for(static_cast<uint64_t>(widest))),
                    static_cast<unsigned>(count));
    if (mode == 1) {
      scale_accumulate_kernel<1><<<grid, kThreads, 0, stream>>>(batch, scale);
    } else {
      scale_accumulate_kernel<0><<<grid, kThreads, 0, stream>>>(batch, scale);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace chameleon

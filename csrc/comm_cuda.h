// Interface between comm.cpp (host code, built by the C++ compiler) and comm_cuda.cu (built by
// nvcc). Plain structs and a cudaStream_t only: no ATen or pybind11 types cross this boundary, so
// the .cu file stays small and quick to compile. Only compiled with -DCHAMELEON_WITH_CUDA.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace chameleon {
namespace cuda {

// One tensor of a pack: copy `nbytes` from `src` to `dst` and write zeros in [nbytes, padded).
struct CopyDesc {
  const uint8_t* src;
  uint8_t* dst;
  uint64_t nbytes;
  uint64_t padded;
};

// Source dtypes of the fused scaled accumulate (destination is always contiguous float32).
enum SrcKind : int32_t { kSrcF32 = 0, kSrcF16 = 1, kSrcBF16 = 2, kSrcF64 = 3 };

// dst[i] = madd(dst[i], scale, src[i]) for i < n.
struct AccDesc {
  float* dst;
  const void* src;
  int64_t n;
  int32_t kind;  // SrcKind
  int32_t pad_;
};

// Both launch on `stream` and return the cudaError_t of the launch(es) (cudaSuccess when fine).
// mode 1: fused multiply-add (one rounding), mode 0: multiply, round, add, round.
cudaError_t launch_pack_copy(const CopyDesc* descs, int64_t n, cudaStream_t stream);
cudaError_t launch_scale_accumulate(const AccDesc* descs, int64_t n, float scale, int mode,
                                    cudaStream_t stream);

}  // namespace cuda
}  // namespace chameleon

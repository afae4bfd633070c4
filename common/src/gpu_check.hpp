// One check function behind CUDA_CHECK, CUBLAS_CHECK and NCCL_CHECK: a failed call
// becomes an exception naming the call, the file and the line. (Internal to the library;
// included by the CUDA and NCCL sources only.)
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "shardlab/check.hpp"

#if __has_include(<cublas_v2.h>)
#include <cublas_v2.h>
#define SHARDLAB_CHECK_CUBLAS 1
#endif
#if defined(SHARDLAB_HAVE_NCCL) && __has_include(<nccl.h>)
#include <nccl.h>
#define SHARDLAB_CHECK_NCCL 1
#endif

namespace shardlab::gpu {

// cuBLAS and NCCL are opened at run time (gpu_library.hpp): their error strings come
// through the opened library, from cuda.cu and comm_nccl.cpp.
#ifdef SHARDLAB_CHECK_CUBLAS
const char* cublas_status_string(cublasStatus_t s);
#endif
#ifdef SHARDLAB_CHECK_NCCL
const char* nccl_error_string(ncclResult_t r);
#endif

[[noreturn]] inline void fail(const std::string& what, const char* call, const char* file,
                              int line) {
  throw Error(std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " + what);
}

inline void check(cudaError_t e, const char* call, const char* file, int line) {
  if (e != cudaSuccess) fail(cudaGetErrorString(e), call, file, line);
}
#ifdef SHARDLAB_CHECK_CUBLAS
inline void check(cublasStatus_t s, const char* call, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) fail(cublas_status_string(s), call, file, line);
}
#endif
#ifdef SHARDLAB_CHECK_NCCL
inline void check(ncclResult_t r, const char* call, const char* file, int line) {
  if (r != ncclSuccess && r != ncclInProgress) fail(nccl_error_string(r), call, file, line);
}
#endif

}  // namespace shardlab::gpu

#define CUDA_CHECK(call) ::shardlab::gpu::check((call), #call, __FILE__, __LINE__)
#define CUBLAS_CHECK(call) ::shardlab::gpu::check((call), #call, __FILE__, __LINE__)
#define NCCL_CHECK(call) ::shardlab::gpu::check((call), #call, __FILE__, __LINE__)

// cuda: device discovery through the CUDA runtime (compiled only with nvcc present).
#include <cuda_runtime.h>

#include <string>

#include "shardlab/cuda.hpp"

namespace shardlab::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the sticky error, report none
    return 0;
  }
  return n;
}

std::string describe_device(int index) {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, index) != cudaSuccess) return "no CUDA device " + std::to_string(index);
  return std::string(p.name) + ", sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.totalGlobalMem >> 30) + " GiB";
}

}  // namespace shardlab::cuda

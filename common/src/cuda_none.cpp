// cuda: the stand-in for builds without nvcc: there is never a device.
#include "shardlab/cuda.hpp"

namespace shardlab::cuda {
int device_count() { return 0; }
std::string describe_device(int index) {
  return "no CUDA device " + std::to_string(index) + " (this build has no CUDA)";
}
}  // namespace shardlab::cuda

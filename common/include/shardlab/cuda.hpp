// cuda: what the rest of the library asks of the CUDA runtime. Builds without CUDA too
// (then there is never a device).
#pragma once

#include <string>

namespace shardlab::cuda {

/// Number of usable CUDA devices: 0 without a driver, a GPU, or a CUDA build.
int device_count();
/// "NVIDIA H100 80GB HBM3, sm_90, 80 GiB" for device `index`, or why there is none.
std::string describe_device(int index);

}  // namespace shardlab::cuda

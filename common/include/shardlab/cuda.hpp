// cuda: the GPUs a program can use. Tensors in device memory (tensor.hpp) are the way to
// compute on them; this header only finds and picks devices. It builds without CUDA too:
// then there is never a device, and anything that needs one throws UsageError with a
// clear message.
#pragma once

#include <string>

namespace shardlab::cuda {

/// True when this build has CUDA (nvcc was found at configure time).
bool built();
/// Number of usable CUDA devices: 0 without a CUDA build, a driver or a GPU.
int device_count();
/// "NVIDIA H100 80GB HBM3, sm_90, 132 SMs, 79 GiB" for device `index`, or why there is none.
std::string describe_device(int index);
/// Peak FP32 throughput from the device's properties: SMs x FP32 lanes per SM x clock x 2
/// (an FMA is two flops). 0 when the architecture's lanes per SM are not in the table.
double peak_fp32_tflops(int index);
/// Makes `index` the current device of the calling thread (each rank's thread calls it).
void set_device(int index);
/// The calling thread's current device, or -1 without CUDA.
int current_device();
/// The device rank `rank` uses: ranks map to GPUs round robin.
int device_for_rank(int rank);
/// Waits until the calling thread's GPU work is done (for timing).
void synchronize();

}  // namespace shardlab::cuda

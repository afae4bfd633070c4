// cuda: the GPUs a program can use. Tensors in device memory (tensor.hpp) are the way to
// compute on them; this header only finds and picks devices. It builds without CUDA too:
// then there is never a device, and anything that needs one throws UsageError with a
// clear message.
#pragma once

#include <string>

namespace shardlab::cuda {

/// True when this build has CUDA (nvcc was found at configure time).
bool built();
/// Number of usable CUDA devices: 0 without a CUDA build or without a GPU. A GPU that is
/// there but that CUDA cannot use (a driver too old for this build's runtime, CUDA under
/// AddressSanitizer) is an Error that says so, not 0: a GPU test must not pass as skipped.
int device_count();
/// Why CUDA's `error` (with its text) counting the devices is not simply "no GPU", as a
/// message with what to do; "" when there is no GPU at all: the runtime says
/// cudaErrorNoDevice, or `dev` holds no NVIDIA device node (nvidia0, nvidia1, ...).
std::string start_failure(int error, const std::string& error_text,
                          const std::string& dev = "/dev");
/// The first NVIDIA GPU device node in `dev` ("/dev/nvidia0"), or "".
std::string gpu_device_node(const std::string& dev = "/dev");
/// "NVIDIA H100 80GB HBM3, sm_90, 132 SMs, 79 GiB" for device `index`, or why there is none.
std::string describe_device(int index);
/// Peak FP32 throughput from the device's properties: SMs x FP32 lanes per SM x clock x 2
/// (an FMA is two flops). 0 when the architecture's lanes per SM are not in the table.
double peak_fp32_tflops(int index);
/// Makes `index` the current device of the calling thread (each rank's thread calls it).
void set_device(int index);
/// The calling thread's current device, or -1 without CUDA.
int current_device();
/// The device rank `rank` uses: ranks map to GPUs round robin. `rank` is the rank's
/// place on its own machine (local_rank).
int device_for_rank(int rank);
/// A process's place among the processes of its own machine, which picks its GPU: what
/// the launcher says (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID), so that
/// on two nodes of 4 GPUs world ranks 4-7 use GPUs 0-3 again; `rank` where none does.
int local_rank(int rank);
/// Waits until the calling thread's GPU work is done (for timing).
void synchronize();

/// Times GPU work with two CUDA events on the calling thread's stream: the time the GPU
/// spent between start() and stop(), not the host's launch loop. stop() waits for it.
class EventTimer {
 public:
  /// Creates the two events (UsageError in a build without CUDA).
  EventTimer();
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  /// Records the start event on the calling thread's stream.
  void start();
  /// Seconds since start(), on the GPU.
  double stop();

 private:
  void* begin_ = nullptr;
  void* end_ = nullptr;
};

}  // namespace shardlab::cuda

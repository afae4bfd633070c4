// cuda: the stand-in for builds without nvcc. There is never a device; whatever needs
// one says so.
#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"

namespace shardlab::cuda {

namespace {
[[noreturn]] void no_cuda() {
  throw UsageError("this build has no CUDA (install the CUDA toolkit and rebuild)");
}
}  // namespace

bool built() { return false; }
int device_count() { return 0; }
std::string describe_device(int index) {
  return "no CUDA device " + std::to_string(index) + " (this build has no CUDA)";
}
double peak_fp32_tflops(int) { return 0; }
void set_device(int) { no_cuda(); }
int device_for_rank(int) { no_cuda(); }
void synchronize() {}
DeviceTensor::DeviceTensor(std::int64_t, std::int64_t) { no_cuda(); }
DeviceTensor::~DeviceTensor() = default;
DeviceTensor::DeviceTensor(DeviceTensor&& o) noexcept
    : data_(o.data_), rows_(o.rows_), cols_(o.cols_) {}
DeviceTensor& DeviceTensor::operator=(DeviceTensor&&) noexcept { return *this; }
DeviceTensor DeviceTensor::to_device(const Tensor&) { no_cuda(); }
Tensor DeviceTensor::to_host() const { no_cuda(); }
void copy(void*, const void*, std::size_t) { no_cuda(); }
DeviceTensor matmul(const DeviceTensor&, const DeviceTensor&) { no_cuda(); }
DeviceTensor matmul(const DeviceTensor&, const DeviceTensor&, bool, bool) { no_cuda(); }
void add_row(DeviceTensor&, const DeviceTensor&) { no_cuda(); }
DeviceTensor column_sums(const DeviceTensor&) { no_cuda(); }
void axpy(float, const DeviceTensor&, DeviceTensor&) { no_cuda(); }
void scale(DeviceTensor&, float) { no_cuda(); }
DeviceTensor add(const DeviceTensor&, const DeviceTensor&) { no_cuda(); }
DeviceTensor tanh_forward(const DeviceTensor&) { no_cuda(); }
DeviceTensor tanh_backward(const DeviceTensor&, const DeviceTensor&) { no_cuda(); }
void adam_step(DeviceTensor&, const DeviceTensor&, DeviceTensor&, DeviceTensor&, float, float,
               float, float, int) {
  no_cuda();
}
float max_abs_diff(const DeviceTensor&, const DeviceTensor&) { no_cuda(); }
DeviceHalves::DeviceHalves(std::size_t, HalfKind) { no_cuda(); }
DeviceHalves::~DeviceHalves() = default;
DeviceHalves::DeviceHalves(DeviceHalves&& o) noexcept
    : data_(o.data_), count_(o.count_), kind_(o.kind_) {}
DeviceHalves& DeviceHalves::operator=(DeviceHalves&&) noexcept { return *this; }
std::vector<std::uint16_t> DeviceHalves::to_host() const { no_cuda(); }
DeviceHalves cast_to_half(const DeviceTensor&, HalfKind, bool*) { no_cuda(); }
DeviceTensor cast_to_float(const DeviceHalves&) { no_cuda(); }
void reduce_into(void*, const void*, std::size_t, DType, ReduceOp) { no_cuda(); }
void finish_reduce(void*, std::size_t, DType, ReduceOp, int) { no_cuda(); }

}  // namespace shardlab::cuda

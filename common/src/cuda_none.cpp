// cuda: the stand-in for builds without nvcc. There is never a device, so no tensor is ever
// in device memory; whatever would need one says so.
#include "kernels.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"

namespace shardlab {

namespace {
[[noreturn]] void no_cuda() {
  throw UsageError("this build has no CUDA (install the CUDA toolkit and rebuild)");
}
}  // namespace

namespace cuda {
bool built() { return false; }
int device_count() { return 0; }
std::string describe_device(int index) {
  return "no CUDA device " + std::to_string(index) + " (this build has no CUDA)";
}
double peak_fp32_tflops(int) { return 0; }
void set_device(int) { no_cuda(); }
int current_device() { return -1; }
int device_for_rank(int) { no_cuda(); }
EventTimer::EventTimer() { no_cuda(); }
EventTimer::~EventTimer() = default;
void EventTimer::start() { no_cuda(); }
double EventTimer::stop() { no_cuda(); }
void synchronize() {}
}  // namespace cuda

namespace kernels {
void* device_alloc(std::size_t, int*) { no_cuda(); }
void device_free(void*) {}
void copy(void*, const void*, std::size_t) { no_cuda(); }
void copy_2d(void*, std::size_t, const void*, std::size_t, std::size_t, std::size_t) { no_cuda(); }
void zero(void*, std::size_t) { no_cuda(); }
void fill(void*, std::int64_t, DType, double) { no_cuda(); }
void transpose(const void*, void*, std::int64_t, std::int64_t, std::size_t) { no_cuda(); }
void binary(Binary, const float*, const float*, float*, std::int64_t) { no_cuda(); }
void axpy(float, const float*, float*, std::int64_t) { no_cuda(); }
void scale(float*, float, std::int64_t) { no_cuda(); }
void add_row(float*, const float*, std::int64_t, std::int64_t) { no_cuda(); }
void column_sums(const float*, float*, std::int64_t, std::int64_t) { no_cuda(); }
void tanh_forward(const float*, float*, std::int64_t) { no_cuda(); }
void tanh_backward(const float*, const float*, float*, std::int64_t) { no_cuda(); }
void gelu_forward(const float*, float*, std::int64_t) { no_cuda(); }
void gelu_backward(const float*, const float*, float*, std::int64_t) { no_cuda(); }
void adam_step(float*, const float*, float*, float*, std::int64_t, float, float, float, float,
               float, float, float, float) {
  no_cuda();
}
void layernorm_forward(const float*, const float*, const float*, float*, float*, float*,
                       std::int64_t, std::int64_t, float) {
  no_cuda();
}
void layernorm_backward_input(const float*, const float*, const float*, const float*, const float*,
                              float*, std::int64_t, std::int64_t) {
  no_cuda();
}
void layernorm_backward_weight(const float*, const float*, const float*, const float*, float*,
                               float*, std::int64_t, std::int64_t) {
  no_cuda();
}
void attention_forward(const float*, float*, float*, std::int64_t, std::int64_t, std::int64_t,
                       std::int64_t, float) {
  no_cuda();
}
void attention_backward(const float*, const float*, const float*, float*, float*, std::int64_t,
                        std::int64_t, std::int64_t, std::int64_t, float) {
  no_cuda();
}
void cross_entropy_forward(const float*, const void*, DType, float*, double*, std::int64_t,
                           std::int64_t) {
  no_cuda();
}
void cross_entropy_backward(float*, const void*, DType, std::int64_t, std::int64_t) { no_cuda(); }
void cast(const void*, DType, void*, DType, std::int64_t) { no_cuda(); }
double max_abs_diff(const void*, const void*, DType, std::int64_t) { no_cuda(); }
bool all_finite(const void*, DType, std::int64_t) { no_cuda(); }
bool index_rows(const void*, std::int64_t, std::size_t, const void*, DType, std::int64_t, void*) {
  no_cuda();
}
bool scatter_add_rows(float*, std::int64_t, std::int64_t, const void*, DType, std::int64_t,
                      const float*) {
  no_cuda();
}
void matmul(const void*, const void*, void*, DType, std::int64_t, std::int64_t, std::int64_t, bool,
            bool, std::int64_t, std::int64_t) {
  no_cuda();
}
void reduce_into(void*, const void*, std::size_t, DType, ReduceOp) { no_cuda(); }
void finish_reduce(void*, std::size_t, DType, ReduceOp, int) { no_cuda(); }
void synchronize() {}
}  // namespace kernels

}  // namespace shardlab

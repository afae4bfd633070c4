// kernels: what the library asks of a GPU, on raw device pointers. tensor.cpp, nn.cpp and
// the communicators call these for tensors in device memory; cuda.cu implements them
// (kernels, cuBLAS, cudaMemcpy), cuda_none.cpp stands in where CUDA is not built (every
// call then throws). Internal to the library: chapters use tensor.hpp.
//
// All work goes on the calling thread's stream (each rank's thread has its own); calls
// that return a host value, or copy to the host, wait for it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shardlab/dtype.hpp"

namespace shardlab::kernels {

// -- memory -------------------------------------------------------------------------
/// cudaMalloc on the current device (its index in *device); throws on failure.
void* device_alloc(std::size_t bytes, int* device);
void device_free(void* p);
/// cudaMemcpy, any direction (cudaMemcpyDefault), then waits for it.
void copy(void* dst, const void* src, std::size_t bytes);
/// `height` rows of `width` bytes from src (rows `src_pitch` apart) to dst (`dst_pitch`).
void copy_2d(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
             std::size_t width, std::size_t height);
void zero(void* p, std::size_t bytes);
/// dst (cols x rows) = the transpose of src (rows x cols), elements of `elem` bytes.
void transpose(const void* src, void* dst, std::int64_t rows, std::int64_t cols, std::size_t elem);
void fill(void* p, std::int64_t n, DType type, double value);

// -- elementwise, f32 -------------------------------------------------------------------
enum class Binary { add, sub, mul };
void binary(Binary op, const float* a, const float* b, float* out, std::int64_t n);
void axpy(float alpha, const float* x, float* y, std::int64_t n);
void scale(float* x, float s, std::int64_t n);
void add_row(float* y, const float* row, std::int64_t rows, std::int64_t cols);
void column_sums(const float* x, float* out, std::int64_t rows, std::int64_t cols);
void tanh_forward(const float* x, float* y, std::int64_t n);
void tanh_backward(const float* y, const float* dy, float* dx, std::int64_t n);
void gelu_forward(const float* x, float* y, std::int64_t n);
void gelu_backward(const float* x, const float* dy, float* dx, std::int64_t n);
/// One Adam step on every element, as nn.cpp's host loop (PyTorch's single-tensor step):
/// g += l2 p; p *= keep; m = lerp(m, g, m_weight); v = v v_keep + v_weight g g;
/// p += -step_size m / (sqrt(v) / correction2_sqrt + eps).
void adam_step(float* p, const float* g, float* m, float* v, std::int64_t n, float m_weight,
               float v_keep, float v_weight, float step_size, float correction2_sqrt, float eps,
               float l2, float keep);

// -- layers, f32 (nn.cpp) -------------------------------------------------------------------
// Each follows nn.cpp's host loop step for step: the same formula, the same float operations
// in the same order without fused multiply-adds, and the same sums in double. Only a sum
// taken in parallel (in double) and expf can round differently: a few ulp.

/// LayerNorm over `rows` rows of `cols`: mean and rstd = 1/sqrt(var + eps) of each row (in
/// double, then rounded), y = (x - mean) * rstd * gamma + beta.
void layernorm_forward(const float* x, const float* gamma, const float* beta, float* y, float* mean,
                       float* rstd, std::int64_t rows, std::int64_t cols, float eps);
/// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy gamma, xhat = (x - mean) rstd.
void layernorm_backward_input(const float* x, const float* mean, const float* rstd,
                              const float* gamma, const float* dy, float* dx, std::int64_t rows,
                              std::int64_t cols);
/// dgamma += sum over rows of dy xhat, dbeta += sum over rows of dy, rows added in order.
void layernorm_backward_weight(const float* x, const float* mean, const float* rstd,
                               const float* dy, float* dgamma, float* dbeta, std::int64_t rows,
                               std::int64_t cols);
/// Causal self-attention (nn.hpp's layout): x is (batch*sequence) x 3C with each head's q, k, v
/// side by side, C = heads * head_size; y is (batch*sequence) x C; att (batch x heads x
/// sequence x sequence) gets the softmax weights, row t's entries past t left as they are
/// (zero). Scores are q . k * scale.
void attention_forward(const float* x, float* y, float* att, std::int64_t batch,
                       std::int64_t sequence, std::int64_t heads, std::int64_t head_size,
                       float scale);
/// dx (every element written) from dy and the forward's x and att; dscore is scratch the size
/// of att.
void attention_backward(const float* x, const float* att, const float* dy, float* dscore, float* dx,
                        std::int64_t batch, std::int64_t sequence, std::int64_t heads,
                        std::int64_t head_size, float scale);
/// Softmax cross-entropy: probs = softmax of each row of logits (rows x cols), and
/// row_loss[i] = max + log(sum exp(logit - max)) - logit[target[i]] in double. The targets
/// (i32 or i64) must lie in 0..cols-1 (the caller checks).
void cross_entropy_forward(const float* logits, const void* targets, DType target_type,
                           float* probs, double* row_loss, std::int64_t rows, std::int64_t cols);
/// d[i][target[i]] -= 1 for every row i (the caller then divides by the rows).
void cross_entropy_backward(float* d, const void* targets, DType target_type, std::int64_t rows,
                            std::int64_t cols);

// -- types and indices ------------------------------------------------------------------
/// out = in converted element by element (to f16/bf16: round to nearest even).
void cast(const void* in, DType from, void* out, DType to, std::int64_t n);
/// max |a - b| (or max |a| when b is null) over n elements of a floating type, as a host
/// double; NaN when any is NaN.
double max_abs_diff(const void* a, const void* b, DType type, std::int64_t n);
/// True when no element is inf or NaN.
bool all_finite(const void* x, DType type, std::int64_t n);
/// out[i] = src[index[i]], rows of `row_bytes`; returns false (and copies nothing
/// meaningful) when an index is outside 0..src_rows-1.
bool index_rows(const void* src, std::int64_t src_rows, std::size_t row_bytes, const void* index,
                DType index_type, std::int64_t n, void* out);
/// dst[index[i]] += src[i], rows of `cols` floats, in order of i; false on a bad index.
bool scatter_add_rows(float* dst, std::int64_t dst_rows, std::int64_t cols, const void* index,
                      DType index_type, std::int64_t n, const float* src);

// -- matmul ---------------------------------------------------------------------------
/// out (M x N, row-major) = op(a) @ op(b) through cuBLAS; a and b are row-major with
/// `a_cols` and `b_cols` columns as stored. f32 (FP32 math, no TF32), or f16/bf16 inputs and
/// output with f32 accumulation.
void matmul(const void* a, const void* b, void* out, DType type, std::int64_t M, std::int64_t N,
            std::int64_t K, bool transpose_a, bool transpose_b, std::int64_t a_cols,
            std::int64_t b_cols);

// -- reductions for the communicators -----------------------------------------------------
/// acc = op(acc, x) over `count` elements of f32, f64, i32, i64 or u8 (x may live on
/// another device). f16 and bf16 are reduced by casting to f32 first (the caller does).
void reduce_into(void* acc, const void* x, std::size_t count, DType type, ReduceOp op);
/// For avg: divides by `ranks`.
void finish_reduce(void* acc, std::size_t count, DType type, ReduceOp op, int ranks);

/// Waits for the calling thread's device work.
void synchronize();

}  // namespace shardlab::kernels

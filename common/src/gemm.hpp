// gemm: the host f32 matrix product behind matmul (tensor.cpp), on raw row-major arrays.
//
// Every kernel here computes c = op(a) @ op(b), c M x N, with the same result bit for bit:
// c(i, j) starts at +0.0f and takes `sum = fma(a(i, k), b(k, j), sum)` (the product and the
// sum rounded once, together) for k = 0, 1, ..., K-1 in that order. So an element does not
// depend on M, N, on which rows or columns a shard holds, on which operand is transposed,
// or on which kernel ran, and a row or column shard's matmul equals those elements of the
// whole one bit for bit. NaN and inf propagate as in that loop (0 * inf is NaN).
//
// Layouts: a is M x K (K x M when transpose_a), b is K x N (N x K when transpose_b), c is
// M x N, all row-major and dense. c must not overlap a or b.
#pragma once

#include <cstdint>

namespace shardlab::gemm {

/// The kernels. `reference` is the definition: plain loops (vectorised across columns by
/// the compiler where the CPU has FMA). `avx2` and `avx512` are blocked: packed panels and
/// a register-tiled micro-kernel of fused multiply-adds, for x86-64 CPUs with AVX2 + FMA
/// and with AVX-512F. The build stays portable: each is chosen at run time.
enum class Kernel { reference, avx2, avx512 };

/// "reference", "avx2", "avx512": the names SHARDLAB_GEMM takes.
const char* kernel_name(Kernel kernel);

/// True when this CPU can run `kernel` (the reference runs everywhere).
bool kernel_available(Kernel kernel);

/// The kernel matmul uses: the one SHARDLAB_GEMM names, else the fastest this CPU has
/// (avx512, then avx2, then the reference). Read once; throws UsageError naming the
/// variable when it names no kernel or one this CPU cannot run.
Kernel kernel_in_use();

/// A blocked kernel's blocking: its register tile of c (tile_rows x tile_cols), and the cache
/// blocks it packs (k_block values of k, row_block rows of op(a), col_block columns of
/// op(b)). The tests probe these edges. The reference's is all zeros.
struct Blocking {
  std::int64_t tile_rows = 0;
  std::int64_t tile_cols = 0;
  std::int64_t k_block = 0;
  std::int64_t row_block = 0;
  std::int64_t col_block = 0;
};
Blocking kernel_blocking(Kernel kernel);

/// The definition: plain loops, no blocking.
void host_matmul_reference_f32(const float* a, const float* b, float* c, std::int64_t M,
                               std::int64_t N, std::int64_t K, bool transpose_a, bool transpose_b);

/// The same result through `kernel`, which must be available. One thread; reentrant (the
/// packing buffers are the calling thread's own).
void host_matmul_kernel_f32(Kernel kernel, const float* a, const float* b, float* c, std::int64_t M,
                            std::int64_t N, std::int64_t K, bool transpose_a, bool transpose_b);

/// The same result through kernel_in_use().
void host_matmul_fast_f32(const float* a, const float* b, float* c, std::int64_t M, std::int64_t N,
                          std::int64_t K, bool transpose_a, bool transpose_b);

/// For the tests: the avx512 kernel's tile and blocks, run with AVX2 registers (four per
/// tile row instead of two of AVX-512's), so that its shape's edges are checked on a CPU
/// without AVX-512. Needs kernel_available(Kernel::avx2).
void host_matmul_avx512_shape_on_avx2_f32(const float* a, const float* b, float* c, std::int64_t M,
                                          std::int64_t N, std::int64_t K, bool transpose_a,
                                          bool transpose_b);

}  // namespace shardlab::gemm

// gemm: the host f32 matrix product behind matmul (tensor.cpp), on raw row-major arrays.
//
// Every function here computes c = op(a) @ op(b), c M x N, with the same result bit for
// bit: c(i, j) starts at +0.0f and adds a(i, k) * b(k, j) (the product rounded to f32,
// then the sum rounded: no fused multiply-add) for k = 0, 1, ..., K-1 in that order. So an
// element does not depend on M, N, on which rows or columns a shard holds, or on which
// operand is transposed, and a row or column shard's matmul equals those elements of the
// whole one bit for bit. NaN and inf propagate as in that loop (0 * inf is NaN).
//
// Layouts: a is M x K (K x M when transpose_a), b is K x N (N x K when transpose_b), c is
// M x N, all row-major and dense. c must not overlap a or b.
#pragma once

#include <cstdint>

namespace shardlab::gemm {

/// The blocked kernel's shape: tiles of c of 6 x 16 in registers; for each block of 2048
/// columns and 384 values of k, op(b) is packed (16-column panels of 24 KiB stay in L1),
/// and for each block of 96 rows, op(a) (144 KiB, in L2). Tests probe these edges.
inline constexpr std::int64_t blocked_tile_rows = 6, blocked_tile_cols = 16;
inline constexpr std::int64_t blocked_k_block = 384, blocked_row_block = 96,
                              blocked_col_block = 2048;

/// The definition: plain loops, no blocking. Slow (about 10 GFLOP/s on one core).
void host_matmul_reference_f32(const float* a, const float* b, float* c, std::int64_t M,
                               std::int64_t N, std::int64_t K, bool transpose_a, bool transpose_b);

/// True when this CPU runs the blocked kernel (x86-64 with AVX2, checked at run time).
bool host_matmul_blocked_available();

/// The same result, cache- and register-blocked (packed panels, a 6 x 16 AVX2 micro-kernel
/// doing separate multiplies and adds). Needs host_matmul_blocked_available(). One thread;
/// reentrant (the packing buffers are the calling thread's own).
void host_matmul_blocked_f32(const float* a, const float* b, float* c, std::int64_t M,
                             std::int64_t N, std::int64_t K, bool transpose_a, bool transpose_b);

/// The blocked kernel where the CPU has it, else the reference.
void host_matmul_fast_f32(const float* a, const float* b, float* c, std::int64_t M, std::int64_t N,
                          std::int64_t K, bool transpose_a, bool transpose_b);

}  // namespace shardlab::gemm

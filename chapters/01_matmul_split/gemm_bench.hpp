// Chapter 01's GEMM benchmark (--benchmark): how close one device's matmul comes to its peak.
//
// On a GPU: cuBLAS SGEMM at n = 1024 .. 8192, checked against the CPU first. On the host:
// the reference loop and the blocked kernel at n = 256, 512 and 1024 (the same bits, so
// the speed-up is the blocking's and the vector units'), then the products chapter 09's
// GPT makes: M = 1024 rows (16 sequences of 64 tokens) by N, K in {128, 384, 512}, in the
// three forms a Linear layer uses (x @ W forward, dy @ W^T for dx, x^T @ dy for dW).
// scripts/gemm_vs_numpy.py times numpy's BLAS on the same shapes, in turns with this.
#pragma once

#include "shardlab/launch.hpp"

namespace ch01 {

/// Times the GEMMs and reports them (tables "gemm", "gemm_gflops", "gemm_shapes");
/// `peak` is the device's FP32 TFLOP/s, or 0 to look it up (GPUs) or leave it unknown.
void gemm_benchmark(shardlab::Context& ctx, double peak);

}  // namespace ch01

// Chapter 01's GEMM benchmark: see gemm_bench.hpp.
#include "gemm_bench.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardlab/bench.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/format.hpp"
#include "shardlab/results.hpp"
#include "shardlab/timer.hpp"

using namespace shardlab;

namespace ch01 {

namespace {

/// The capstone's products (M = 1024; N, K in {128, 384, 512}) in a Linear's three forms,
/// each the best of three rounds of about 0.1 GFLOP, in GFLOP/s.
void capstone_shapes(Context& ctx) {
  struct Form {
    const char* name;
    bool transpose_a, transpose_b;
  };
  const Form forms[] = {{"x@W", false, false}, {"dy@W^T", false, true}, {"x^T@dy", true, false}};
  Table shapes({"M", "N", "K", "form", "gflops"});
  const std::int64_t rows = 1024;
  for (const std::int64_t N : {128, 384, 512})
    for (const std::int64_t K : {128, 384, 512})
      for (const Form& f : forms) {
        // x^T @ dy (the weight's gradient) sums over the 1024 rows: there they are k.
        const std::int64_t m = f.transpose_a ? K : rows, k = f.transpose_a ? rows : K;
        const Tensor a = f.transpose_a ? randn(k, m, 5) : randn(m, k, 5);
        const Tensor b = f.transpose_b ? randn(N, k, 6) : randn(k, N, 6);
        Tensor out = empty(Shape{m, N});
        const double flops = 2.0 * double(m) * double(N) * double(k);
        const int iterations = std::max(1, int(1e8 / flops));
        double best = 1e30;
        for (int round = 0; round < 3; ++round) {
          matmul_into(out, a, b, f.transpose_a, f.transpose_b);  // warm: caches, packing buffers
          Stopwatch watch;
          for (int i = 0; i < iterations; ++i) matmul_into(out, a, b, f.transpose_a, f.transpose_b);
          best = std::min(best, watch.seconds() / iterations);
        }
        ctx.verify(out.bitwise_equal(matmul_reference(a, b, f.transpose_a, f.transpose_b)),
                   std::string("GEMM benchmark: ") + f.name + " differs from matmul_reference");
        shapes.add({m, N, k, f.name, flops / best * 1e-9});
      }
  ctx.report(shapes, "gemm_shapes",
             "\nThe capstone's products (chapter 09: 1024 tokens a step), GFLOP/s, one core");
}

}  // namespace

void gemm_benchmark(Context& ctx, double peak) {
  const bool gpu = ctx.on_gpu();
  std::string what = std::string("cpu: the reference loop vs the blocked kernel (") +
                     host_matmul_kernel() + "), one core";
  if (gpu) {
    const int device = cuda::device_for_rank(0);
    what = "cuda: cuBLAS SGEMM on " + cuda::describe_device(device);
    if (peak == 0) peak = cuda::peak_fp32_tflops(device);
    // Validate against the CPU reference before timing anything.
    const Tensor a = randn(256, 256, 1), b = randn(256, 256, 2);
    const Tensor got = matmul(a.to(Memory::device), b.to(Memory::device)).to(Memory::host);
    const float bound = matmul_reorder_bound(a, b);
    const double diff =
        ctx.verify_close("cuBLAS 256^3", max_abs_diff(got, matmul(a, b)), bound, "the CPU matmul");
    ctx.say("validated: cuBLAS vs CPU on 256^3, max abs diff " + format_number(diff, 3) +
            " (bound " + format_number(bound, 3) + ")");
  }
  // Every rank times its own device; the table shows the slowest. The output is allocated
  // once per size, so only the GEMM is timed.
  Tensor a, b, out;
  bench::Case gemm;
  gemm.name = gpu ? "cublas_sgemm" : "cpu_blocked";
  gemm.prepare = [&](std::int64_t n) {
    a = randn(n, n, 3).to(ctx.memory()), b = randn(n, n, 4).to(ctx.memory());
    out = empty(Shape{n, n}, DType::f32, ctx.memory());
  };
  gemm.run = [&] { matmul_into(out, a, b); };
  bench::Case reference = gemm;  // the same operands through the reference loop
  reference.name = "cpu_reference", reference.run = [&] { matmul_reference_into(out, a, b); };
  bench::Config config;
  config.title = "GEMM benchmark (" + what + "), FP32, n x n x n";
  config.measure = bench::Measure::throughput;
  config.flops = [](std::int64_t n) { return 2.0 * double(n) * double(n) * double(n); };
  config.peak_tflops = peak;
  config.iterations = 5, config.warmup = 1;
  config.csv_name = "01_matmul_split", config.json_key = "gemm";
  if (gpu) {  // the GPU's own time for the GEMMs (CUDA events), not the launch loop's
    config.synchronize = [] { cuda::synchronize(); };
    config.device_clock = true;
  }
  ctx.say("");
  const std::vector<bench::Row> rows =
      gpu ? bench::run(ctx, config, {gemm}, {1024, 2048, 4096, 8192})
          : bench::run(ctx, config, {reference, gemm}, {256, 512, 1024});
  if (!gpu) {  // the clear loop and the kernel that gives its bits, side by side
    const std::vector<bench::Row> loop = bench::rows_of(rows, reference.name),
                                  kernel = bench::rows_of(rows, gemm.name);
    Table speed({"n", "reference_gflops", "blocked_gflops", "speedup"});
    for (std::size_t i = 0; i < loop.size() && i < kernel.size(); ++i)
      speed.add({loop[i].count, loop[i].tflops * 1e3, kernel[i].tflops * 1e3,
                 loop[i].tflops > 0 ? kernel[i].tflops / loop[i].tflops : 0.0});
    ctx.report(speed, "gemm_gflops",
               "\nHost GEMM on one core, GFLOP/s: the reference loop and the blocked kernel");
    capstone_shapes(ctx);
  }
  if (peak == 0) ctx.say("  (peak not known for this device: give it with --peak-tflops)");
  ctx.json()["gemm_device"] = what;
  ctx.json()["gemm_kernel"] = gpu ? "cublas" : host_matmul_kernel();
  ctx.json()["peak_tflops"] = peak;
}

}  // namespace ch01

// Chapter 01 — one matmul, split three ways.
//
// The course's picture (so-large-lm ch. 8 "分布式训练" §2-§4; CS336 lecture 7, tensor
// parallelism): a layer computes out = x @ w with x 4x5 and w 5x8. Split x by rows and
// every rank computes some rows of out (data parallel); split w by columns and every
// rank computes some columns (model parallel, Megatron's ColumnParallelLinear); split
// the inner dimension and every rank computes a partial sum of every element (Megatron's
// RowParallelLinear). The program runs all three on P ranks, compares each with the
// single-device x @ w, and sets the elements each one received — measured by the
// communicator's counters — next to the formula. Then it runs the data-parallel backward
// pass: each rank's dL/dw differs, and only their sum is the true gradient (chapter 02).
//
// Simplified: every rank builds the full x and w from the seed and takes its shard (a
// real job loads only its shard), so the counted traffic is the output's alone.
//
// Run:
//   build/default/bin/ch01_matmul_split                  2 ranks as threads (the seed's picture)
//   build/default/bin/ch01_matmul_split --ranks 3 --rows 7 --inner 5 --cols 9
//   mpirun -np 3 build/default/bin/ch01_matmul_split     3 MPI processes, same numbers
//   ... --json                                           one JSON object on stdout
//   ... --device cuda                                    the matmuls on GPUs (cuBLAS), the
//                                                        communication on device buffers
//   ... --benchmark [--device cuda]                      GEMM throughput next to the peak
//
// Expected (2 ranks): data and column parallel bitwise equal to x @ w, each 32 elements
// received in all ((P-1)*M*N); row parallel within the rounding bound, 64 (2*(P-1)*M*N);
// the ranks' dL/dw differ by up to 8.38, and their sum is x^T @ out within rounding.
#include <nlohmann/json.hpp>
#include <string>

#include "gemm_bench.hpp"    // defines: the GEMM benchmark (--benchmark)
#include "matmul_split.hpp"  // defines: the three strategies (the exercise)
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/results.hpp"
#include "strategies.hpp"  // defines: their table (what each cuts, communicates, costs)

using namespace shardlab;

int main(int argc, char** argv) {
  Program program("ch01_matmul_split",
                  "Chapter 01: one matmul, split by rows, by columns, and by the inner dimension");
  ch01::Dims d{4, 5, 8};
  program.cli()
      .add_option("--rows", d.M, "M, rows of x and out")
      ->check(shardlab::cli::whole(1, 4096));
  program.cli()
      .add_option("--inner", d.K, "K, columns of x = rows of w")
      ->check(shardlab::cli::whole(1, 4096));
  program.cli()
      .add_option("--cols", d.N, "N, columns of w and out")
      ->check(shardlab::cli::whole(1, 4096));
  for (const char* flag : {"--rows", "--inner", "--cols"})
    program.cli().get_option(flag)->capture_default_str();
  program.supports_cuda();
  bool bench = false;
  double peak = 0;
  program.cli().add_flag("--benchmark", bench,
                         "after the strategies, time one device's GEMM against its peak");
  program.cli()
      .add_option("--peak-tflops", peak, "the device's FP32 peak, when its properties do not tell")
      ->check(cli::between(0.0, 1e6));
  // Memory: every rank holds x and w whole, the reference, its shards and the gathered
  // results (about six M x N tensors); the ranks of a threads job share this machine.
  program.memory_estimate([&](const Options& o) {
    // Measured (peak resident memory at 1024-4096 per side, 1-4 ranks): about 4 floats of
    // each of x, w and out per rank (its shards, results, the backward, the rounding
    // bound's |x| and |w| copies) and 3 more for the process: this is 1.1-1.2 times that.
    const double M = double(d.M), K = double(d.K), N = double(d.N);
    const double ranks = o.backend == "threads" || o.backend == "auto" ? o.ranks : 1;
    return 4.0 * (4.5 * ranks + 3.5) * (M * K + K * N + M * N);
  });
  program.writes_csv([&] { return bench; });

  return program.run(argc, argv, [&](Context& ctx) {
    const int P = ctx.size(), r = ctx.rank();
    const std::uint64_t seed = ctx.options().seed;
    const Tensor x = randn(d.M, d.K, seed * 2 + 1), w = randn(d.K, d.N, seed * 2 + 2);
    // The matrices are drawn up to 12 x 12, each rank's piece marked.
    const bool show = ctx.talking() && d.M <= 12 && d.K <= 12 && d.N <= 12;
    auto print = [&](const Tensor& t, const std::string& name, int split) {
      const ShardView view = split < 0 ? ShardView{} : ShardView{P, split};
      if (show) ctx.say(format(t, name, {view, 3, ctx.color()}));
    };
    ctx.say("Chapter 01 - out = x @ w with x " + std::to_string(d.M) + "x" + std::to_string(d.K) +
            ", w " + std::to_string(d.K) + "x" + std::to_string(d.N) + ", on " + std::to_string(P) +
            " rank" + (P > 1 ? "s" : "") + " (" + std::string(ctx.comm().backend()) +
            " backend)\n");
    ctx.json()["chapter"] = "01_matmul_split";
    ctx.json()["shape"] = {{"M", d.M}, {"K", d.K}, {"N", d.N}};

    // -----------------------------------------------------------------------
    // The single-device reference, and how far another summation order may stray from it.
    const Tensor ref = matmul(x, w);
    print(ref, "reference out = x @ w", -1);
    const float bound = matmul_reorder_bound(x, w);

    // -----------------------------------------------------------------------
    // 1-3. The three strategies on the ranks: compared with x @ w (bitwise where the
    // summation order is the reference's: not on a GPU, where cuBLAS sums in its own order),
    // and the elements each received, summed over ranks, next to its formula.
    Table comparison({"strategy", "max_abs_diff", "tolerance", "bitwise_equal"});
    Table traffic(
        {"strategy", "received", "per_rank", "formula", "formula_elements", "traffic_modeled"});
    bool modeled = false;
    for (int step = 1; const ch01::Strategy& s : ch01::strategies()) {
      ctx.say("\n" + std::to_string(step++) + ". " + s.title + ": split " + s.splits);
      print(x, "x", s.x_split);
      print(w, "w", s.w_split);
      ctx.say_each(s.share(d, P, r));
      // --device cuda: the same functions on tensors in this rank's GPU memory (cuBLAS
      // matmuls, gathers of device buffers); out comes back to be checked.
      const Tensor x_here = x.to(ctx.memory()), w_here = w.to(ctx.memory());
      const CommStats before = ctx.comm().stats();
      const Tensor out = s.run(ctx.comm(), x_here, w_here).to(Memory::host);
      const CommStats counted = ctx.comm().stats().since(before);  // what this rank received
      print(out, "out after the " + s.collective, s.out_split);

      const bool bitwise = s.bitwise && !ctx.on_gpu();
      const double diff = ctx.verify_close(s.title + "'s out", max_abs_diff(out, ref),
                                           bitwise ? 0.0f : bound, "x @ w");
      const bool equal = ctx.comm().all_true(out.bitwise_equal(ref));
      if (bitwise) ctx.verify(equal, s.title + ": out is not bitwise x @ w");
      comparison.add({s.key, diff, bitwise ? 0.0f : bound, equal});

      const auto mine = std::int64_t(counted.total().bytes_received / sizeof(float));
      const std::vector<std::int64_t> per_rank = ctx.comm().gather_values(mine);
      std::int64_t received = 0;
      std::string shown;
      for (std::int64_t v : per_rank)
        received += v, shown += (shown.empty() ? "" : " ") + std::to_string(v);
      const std::uint64_t formula = s.elements_received(P, d);
      ctx.verify(std::uint64_t(received) == formula,
                 s.title + ": received " + std::to_string(received) + " elements, formula says " +
                     std::to_string(formula));
      traffic.add({s.key, received, shown, s.formula, formula, counted.any_modeled()});
      modeled = modeled || counted.any_modeled();
    }
    ctx.report(comparison, "comparison",
               "\nout compared with the single-device x @ w (tolerance 0: must be bitwise equal)");
    ctx.report(traffic, "traffic",
               "\nElements received, summed over ranks (and per rank), next to the formula");
    if (modeled)
      ctx.say("  [modeled: " + std::string(ctx.comm().backend()) +
              " hides its algorithm; these are the formula's counts]");

    // -----------------------------------------------------------------------
    // 4. Data-parallel backward. L = 1/2 ||out||^2, so dL/dout = out and
    //    dL/dw = x^T @ out, a sum over all M rows. Rank r sees only its rows.
    ctx.say("\n4. Data-parallel backward: L = 1/2 ||out||^2, dL/dw = x^T @ out (K x N)");
    const Tensor grad_ref = matmul(transpose(x), ref);
    Tensor grad = matmul(transpose(shard(x, P, 0, r)), shard(ref, P, 0, r));  // its rows only
    ctx.say_each("local dL/dw from " + ch01::part("row", d.M, P, r) +
                 ": max |dW_r - dW| = " + format_number(max_abs_diff(grad, grad_ref), 3));
    const double spread = replica_divergence(ctx.comm(), grad);  // each rank's from rank 0's
    ctx.verify(P == 1 || d.M < 2 || spread > 0, "backward: the ranks' gradients should differ");
    ctx.comm().allreduce(grad, ReduceOp::sum);  // what chapter 02 does every step
    const float grad_bound = matmul_reorder_bound(transpose(x), ref);
    const double sum_diff =
        ctx.verify_close("dL/dw summed over ranks", max_abs_diff(grad, grad_ref), grad_bound);
    Table backward({"gradient", "max_abs_diff", "rounding_bound"});
    backward.add({"each rank's own, from rank 0's", spread, grad_bound});
    backward.add({"summed over ranks, from one device's", sum_diff, grad_bound});
    ctx.report(backward, "backward");
    ctx.say(
        "  Only the sum is the gradient: a replica that stepped with its own would drift away\n"
        "  from the others. Chapter 02 computes that sum every step.");

    if (bench) ch01::gemm_benchmark(ctx, peak);
  });
}

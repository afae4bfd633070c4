// Chapter 01 — one matmul, split three ways.
//
// The course's picture (so-large-lm ch. 8 "分布式训练" §2-§4; CS336 lecture 7, tensor
// parallelism): a layer computes out = x @ w with x 4x5 and w 5x8. Split x by rows and
// every rank computes some rows of out (data parallel); split w by columns and every
// rank computes some columns (model parallel, Megatron's ColumnParallelLinear); split
// the inner dimension and every rank computes a partial sum of every element (Megatron's
// RowParallelLinear). The program runs all three on P ranks, checks each against the
// single-device x @ w, and prints the elements each one communicated — measured by the
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
// received in all ((P-1)*M*N); row parallel within rounding, 64 elements (2(P-1)*M*N).
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "matmul_split.hpp"
#include "shardlab/bench.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/results.hpp"

using namespace shardlab;

namespace {

// ---------------------------------------------------------------------------
// One strategy: run it, measure what it received on each rank, compare with x @ w.

struct Strategy {
  const char* key;         // JSON key
  const char* title;       // what the reader sees
  const char* splits;      // what is split
  const char* collective;  // what it communicates
  const char* formula_text;
  Tensor (*run)(Communicator&, const Tensor&, const Tensor&);
  std::uint64_t formula;  // elements received, summed over ranks
  bool bitwise;           // the summation order is the reference's, so exact
  ShardView x_view, w_view, out_view;
};

struct Result {
  Tensor out;
  double max_abs_diff = 0;             // worst over ranks
  bool bitwise_equal = true;           // on every rank
  std::vector<std::int64_t> received;  // elements, per rank
  std::int64_t total = 0;
  bool modeled = false;
};

Result measure(Context& ctx, const Strategy& s, const Tensor& x, const Tensor& w,
               const Tensor& ref) {
  Communicator& comm = ctx.comm();
  Result r;
  // --device cuda: the same functions on tensors in this rank's GPU memory (their matmuls
  // run in cuBLAS, their gathers move device buffers); the result comes back to be checked.
  const Tensor x_here = x.to(ctx.memory()), w_here = w.to(ctx.memory());
  const CommStats before = comm.stats();
  r.out = s.run(comm, x_here, w_here).to(Memory::host);
  const CommStats delta = comm.stats().since(before);
  const std::int64_t mine = static_cast<std::int64_t>(delta.total().bytes_received / sizeof(float));
  r.modeled = delta.any_modeled();
  // Bookkeeping from here on (uncounted): the per-rank counts and the worst diff.
  r.received = comm.gather_values(mine);
  for (std::int64_t v : r.received) r.total += v;
  r.max_abs_diff = comm.agree(max_abs_diff(r.out, ref), ReduceOp::max);
  r.bitwise_equal = comm.all_true(r.out.bitwise_equal(ref));
  return r;
}

std::string join(const std::vector<std::int64_t>& v) {
  std::string s;
  for (std::int64_t x : v) s += (s.empty() ? "" : " ") + std::to_string(x);
  return s;
}

/// "rows 0-1", "row 2", or "no rows": the part of a dimension of `size` that `part` holds.
std::string range_text(const std::string& noun, std::int64_t size, int parts, int part) {
  const ShardRange r = shard_range(size, parts, part);
  if (r.length == 0) return "no " + noun + "s";
  if (r.length == 1) return noun + " " + std::to_string(r.offset);
  return noun + "s " + std::to_string(r.offset) + "-" + std::to_string(r.offset + r.length - 1);
}

// ---------------------------------------------------------------------------
// GEMM benchmark: how close one device's matmul gets to its peak.

void gemm_benchmark(Context& ctx, double given_peak) {
  const bool gpu = ctx.on_gpu();
  std::string what = "cpu: the reference loop vs the blocked kernel, one core";
  double peak = given_peak;
  if (gpu) {
    const int device = cuda::device_for_rank(0);
    what = "cuda: cuBLAS SGEMM on " + cuda::describe_device(device);
    if (peak == 0) peak = cuda::peak_fp32_tflops(device);
    // Validate against the CPU reference before timing anything.
    const Tensor a = randn(256, 256, 1), b = randn(256, 256, 2);
    const Tensor got = matmul(a.to(Memory::device), b.to(Memory::device)).to(Memory::host);
    const double diff = max_abs_diff(got, matmul(a, b));
    const float bound = matmul_reorder_bound(a, b);
    ctx.verify(diff <= bound, "cuBLAS 256^3 differs from the CPU matmul by " + format_number(diff));
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
  if (gpu) config.synchronize = [] { cuda::synchronize(); };
  config.csv_name = "01_matmul_split", config.json_key = "gemm";
  ctx.say("");
  const std::vector<bench::Row> rows =
      bench::run(ctx, config, gpu ? std::vector<bench::Case>{gemm} : std::vector{reference, gemm},
                 gpu ? std::vector<std::int64_t>{1024, 2048, 4096, 8192}
                     : std::vector<std::int64_t>{256, 512, 1024});
  for (std::size_t i = 0; !gpu && i + 1 < rows.size(); i += 2)  // by size: reference, blocked
    ctx.say("  n = " + std::to_string(rows[i].count) + ": GFLOP/s reference " +
            format_number(rows[i].tflops * 1e3, 3) + ", blocked " +
            format_number(rows[i + 1].tflops * 1e3, 3));
  if (peak == 0) ctx.say("  (peak not known for this device: give it with --peak-tflops)");
  ctx.json()["gemm_device"] = what;
  ctx.json()["peak_tflops"] = peak;
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch01_matmul_split",
                  "Chapter 01: one matmul, split by rows, by columns, and by the inner dimension");
  std::int64_t M = 4, K = 5, N = 8;
  program.cli()
      .add_option("--rows", M, "M, rows of x and out")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  program.cli()
      .add_option("--inner", K, "K, columns of x = rows of w")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  program.cli()
      .add_option("--cols", N, "N, columns of w and out")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
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
    const double per_rank = 4.0 * (static_cast<double>(M) * static_cast<double>(K) +
                                   static_cast<double>(K) * static_cast<double>(N) +
                                   6.0 * static_cast<double>(M) * static_cast<double>(N));
    return per_rank * (o.backend == "threads" || o.backend == "auto" ? o.ranks : 1);
  });
  program.writes_csv([&] { return bench; });

  return program.run(argc, argv, [&](Context& ctx) {
    const int P = ctx.size(), r = ctx.rank();
    const std::uint64_t p = static_cast<std::uint64_t>(P), MN = static_cast<std::uint64_t>(M * N);
    const std::uint64_t seed = ctx.options().seed;
    const Tensor x = randn(M, K, seed * 2 + 1), w = randn(K, N, seed * 2 + 2);
    const bool show = ctx.talking() && M <= 12 && K <= 12 && N <= 12;
    const bool color = ctx.color();
    auto print = [&](const Tensor& t, const std::string& name, ShardView view) {
      if (show) ctx.say(format(t, name, {view, 3, color}));
    };

    std::ostringstream head;
    head << "Chapter 01 - out = x @ w with x " << M << "x" << K << ", w " << K << "x" << N
         << ", on " << P << " rank" << (P > 1 ? "s" : "") << " (" << ctx.comm().backend()
         << " backend)\n";
    ctx.say(head.str());

    // -----------------------------------------------------------------------
    // 1. The single-device reference.
    const Tensor ref = matmul(x, w);
    print(ref, "reference out = x @ w", {});

    // -----------------------------------------------------------------------
    // 2. The three strategies.
    const Strategy strategies[] = {
        {"data_parallel",
         "Data parallel",
         "x along dim 0 (rows); w whole on every rank",
         "allgather of out's row shards",
         "(P-1)*M*N",
         ch01::data_parallel_matmul,
         (p - 1) * MN,
         true,
         {P, 0},
         {1, 0},
         {P, 0}},
        {"column_parallel",
         "Model (column) parallel",
         "w along dim 1 (columns); x whole on every rank",
         "allgather of out's column shards",
         "(P-1)*M*N",
         ch01::column_parallel_matmul,
         (p - 1) * MN,
         true,
         {1, 0},
         {P, 1},
         {P, 1}},
        {"row_parallel",
         "Row parallel",
         "x along dim 1 and w along dim 0 (the inner dimension K)",
         "allreduce (sum) of M x N partial products",
         "2*(P-1)*M*N",
         ch01::row_parallel_matmul,
         2 * (p - 1) * MN,
         false,
         {P, 1},
         {P, 0},
         {1, 0}},
    };
    const float bound = matmul_reorder_bound(x, w);
    // On a GPU cuBLAS sums in its own order (and fuses multiply-adds): no strategy is then
    // bitwise, and all are checked against the summation-order bound.
    const bool gpu = ctx.on_gpu();
    nlohmann::json& json = ctx.json();
    json["chapter"] = "01_matmul_split";
    json["shape"] = {{"M", M}, {"K", K}, {"N", N}};
    std::vector<std::string> table;
    int step = 1;
    for (const Strategy& base : strategies) {
      Strategy s = base;
      s.bitwise = s.bitwise && !gpu;
      ctx.say("\n" + std::to_string(step++) + ". " + s.title + ": split " + s.splits);
      print(x, "x", s.x_view);
      print(w, "w", s.w_view);
      // What each rank holds and computes.
      std::ostringstream mine;
      if (std::string(s.key) == "data_parallel")
        mine << "x " << range_text("row", M, P, r) << " @ w -> out " << range_text("row", M, P, r);
      else if (std::string(s.key) == "column_parallel")
        mine << "x @ w " << range_text("column", N, P, r) << " -> out "
             << range_text("column", N, P, r);
      else
        mine << "x " << range_text("column", K, P, r) << " @ w " << range_text("row", K, P, r)
             << " -> a partial sum of all of out";
      ctx.say_each(mine.str());

      const Result res = measure(ctx, s, x, w, ref);
      print(res.out, "out after the " + std::string(s.collective), s.out_view);
      std::ostringstream line;
      line << "   max |out - reference| = " << format_number(res.max_abs_diff, 3);
      if (s.bitwise)
        line << (res.bitwise_equal ? " (bitwise equal)" : " (NOT bitwise equal)");
      else
        line << " (rounding bound " << format_number(bound, 3) << ")";
      line << "\n   communicated: " << res.total << " elements received in all, "
           << (res.modeled ? "modeled" : "measured") << " (per rank: " << join(res.received)
           << "); formula " << s.formula_text << " = " << s.formula
           << (res.modeled ? "  [modeled: " + std::string(ctx.comm().backend()) +
                                 " hides its algorithm; this is the formula's count]"
                           : "");
      ctx.say(line.str());

      const bool correct = s.bitwise ? res.bitwise_equal : res.max_abs_diff <= bound;
      ctx.verify(correct,
                 std::string(s.title) + ": max abs diff " + format_number(res.max_abs_diff) +
                     (s.bitwise ? " (must be bitwise equal)" : " > bound " + format_number(bound)));
      ctx.verify(static_cast<std::uint64_t>(res.total) == s.formula,
                 std::string(s.title) + ": communicated " + std::to_string(res.total) +
                     " elements, formula says " + std::to_string(s.formula));
      json["strategies"][s.key] = {
          {"splits", s.splits},
          {"communicates", s.collective},
          {"max_abs_diff", res.max_abs_diff},
          {"bitwise_equal", res.bitwise_equal},
          {"tolerance", s.bitwise ? 0.0f : bound},
          {"elements_communicated", res.total},
          {"elements_received_per_rank", res.received},
          {"formula", s.formula_text},
          {"formula_elements", s.formula},
          {"traffic_modeled", res.modeled},
      };
      char row[200];
      std::snprintf(row, sizeof row, "  %-24s %10lld %10llu   %s", s.title,
                    static_cast<long long>(res.total), static_cast<unsigned long long>(s.formula),
                    s.bitwise ? (res.bitwise_equal ? "0 (bitwise)" : "DIFFERS")
                              : format_number(res.max_abs_diff, 3).c_str());
      table.push_back(row);
    }

    // -----------------------------------------------------------------------
    // 3. Data-parallel backward. L = 1/2 ||out||^2, so dL/dout = out and
    //    dL/dw = x^T @ out, a sum over all M rows. Rank r sees only its rows.
    ctx.say("\n4. Data-parallel backward: L = 1/2 ||out||^2, dL/dw = x^T @ out (K x N)");
    const Tensor grad_ref = matmul(transpose(x), ref);
    const Tensor x_r = shard(x, P, 0, r), out_r = shard(ref, P, 0, r);
    Tensor grad = matmul(transpose(x_r), out_r);  // this rank's dL/dw, from its rows only
    const double local_diff = max_abs_diff(grad, grad_ref);
    std::ostringstream g;
    g << "local dL/dw from " << range_text("row", M, P, r)
      << ": max |dW_r - dW| = " << format_number(local_diff, 3);
    ctx.say_each(g.str());
    // Do the ranks' gradients differ? Compare each with rank 0's.
    Tensor grad0 = grad.clone();  // a copy: a Tensor is a handle
    {
      Communicator::Uncounted quiet(ctx.comm());
      ctx.comm().broadcast(grad0, 0);
    }
    const double spread = ctx.comm().agree(max_abs_diff(grad, grad0), ReduceOp::max);
    ctx.comm().allreduce(grad, ReduceOp::sum);  // what chapter 02 does every step
    const double sum_diff = ctx.comm().agree(max_abs_diff(grad, grad_ref), ReduceOp::max);
    const float grad_bound = matmul_reorder_bound(transpose(x), ref);
    std::ostringstream b;
    b << "   the ranks' gradients differ by up to " << format_number(spread, 3)
      << ": a replica that stepped with its own would drift away from the others.\n"
      << "   sum over ranks (allreduce) vs single-device dL/dw: max abs diff "
      << format_number(sum_diff, 3) << " (rounding bound " << format_number(grad_bound, 3)
      << "): that sum is the gradient, and chapter 02 computes it every step.";
    ctx.say(b.str());
    ctx.verify(sum_diff <= grad_bound, "backward: the summed gradient is off by " +
                                           format_number(sum_diff) + " > bound " +
                                           format_number(grad_bound));
    ctx.verify(P == 1 || M < 2 || spread > 0, "backward: the ranks' gradients should differ");
    json["backward"] = {{"local_grads_max_spread", spread},
                        {"sum_max_abs_diff", sum_diff},
                        {"tolerance", grad_bound}};

    // -----------------------------------------------------------------------
    // 4. Summary.
    std::string summary =
        "\nSummary (elements received, summed over ranks)\n"
        "  strategy                   measured    formula   max abs diff\n";
    for (const std::string& row : table) summary += row + "\n";
    ctx.say(summary);
    if (bench) gemm_benchmark(ctx, peak);
  });
}

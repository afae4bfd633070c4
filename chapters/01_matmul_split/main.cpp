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
//
// Expected (2 ranks): data and column parallel bitwise equal to x @ w, each 32 elements
// received in all ((P-1)*M*N); row parallel within rounding, 64 elements (2(P-1)*M*N).
#include <algorithm>
#include <cstdio>
#include <sstream>

#include "matmul_split.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/results.hpp"

using namespace shardlab;

namespace {

// ---------------------------------------------------------------------------
// One strategy: run it, measure what it received on each rank, compare with x @ w.

struct Strategy {
  const char* key;          // JSON key
  const char* title;        // what the reader sees
  const char* splits;       // what is split
  const char* collective;   // what it communicates
  const char* formula_text;
  Tensor (*run)(Communicator&, const Tensor&, const Tensor&);
  std::uint64_t formula;    // elements received, summed over ranks
  bool bitwise;             // the summation order is the reference's, so exact
  ShardView x_view, w_view, out_view;
};

struct Result {
  Tensor out;
  float max_abs_diff = 0;       // worst over ranks
  bool bitwise_equal = true;    // on every rank
  std::vector<std::int64_t> received;  // elements, per rank
  std::int64_t total = 0;
  bool modeled = false;
};

Result measure(Context& ctx, const Strategy& s, const Tensor& x, const Tensor& w, const Tensor& ref) {
  Communicator& comm = ctx.comm();
  Result r;
  const CommStats before = comm.stats();
  r.out = s.run(comm, x, w);
  const CommStats delta = comm.stats().since(before);
  const std::int64_t mine = static_cast<std::int64_t>(delta.total().bytes_received / sizeof(float));
  r.modeled = std::any_of(delta.modeled.begin(), delta.modeled.end(), [](bool m) { return m; }) &&
              std::string(comm.backend()) == "mpi";
  // Bookkeeping from here on: agree on the worst diff and collect the per-rank counts.
  Communicator::Uncounted quiet(comm);
  r.received.resize(static_cast<std::size_t>(comm.size()));
  comm.allgather(std::span<const std::int64_t>(&mine, 1), r.received);
  for (std::int64_t v : r.received) r.total += v;
  float diff = max_abs_diff(r.out, ref);
  comm.allreduce(std::span<float>(&diff, 1), ReduceOp::max);
  r.max_abs_diff = diff;
  r.bitwise_equal = comm.all_true(r.out.bitwise_equal(ref));
  return r;
}

std::string join(const std::vector<std::int64_t>& v) {
  std::string s;
  for (std::int64_t x : v) s += (s.empty() ? "" : " ") + std::to_string(x);
  return s;
}

std::string range_text(std::int64_t size, int parts, int part) {
  const ShardRange r = shard_range(size, parts, part);
  return std::to_string(r.offset) + ".." + std::to_string(r.offset + r.length);
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch01_matmul_split", "Chapter 01: one matmul, split by rows, by columns, and by the inner dimension");
  std::int64_t M = 4, K = 5, N = 8;
  program.cli().add_option("--rows", M, "M, rows of x and out")->check(CLI::Range(1, 4096))->capture_default_str();
  program.cli().add_option("--inner", K, "K, columns of x = rows of w")->check(CLI::Range(1, 4096))->capture_default_str();
  program.cli().add_option("--cols", N, "N, columns of w and out")->check(CLI::Range(1, 4096))->capture_default_str();

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
    head << "Chapter 01 - out = x @ w with x " << M << "x" << K << ", w " << K << "x" << N << ", on "
         << P << " rank" << (P > 1 ? "s" : "") << " (" << ctx.comm().backend() << " backend)\n";
    ctx.say(head.str());

    // -----------------------------------------------------------------------
    // 1. The single-device reference.
    const Tensor ref = matmul(x, w);
    print(ref, "reference out = x @ w", {});

    // -----------------------------------------------------------------------
    // 2. The three strategies.
    const Strategy strategies[] = {
        {"data_parallel", "Data parallel", "x along dim 0 (rows); w whole on every rank",
         "allgather of out's row shards", "(P-1)*M*N", ch01::data_parallel_matmul, (p - 1) * MN,
         true, {P, 0}, {1, 0}, {P, 0}},
        {"column_parallel", "Model (column) parallel", "w along dim 1 (columns); x whole on every rank",
         "allgather of out's column shards", "(P-1)*M*N", ch01::column_parallel_matmul,
         (p - 1) * MN, true, {1, 0}, {P, 1}, {P, 1}},
        {"row_parallel", "Row parallel", "x along dim 1 and w along dim 0 (the inner dimension K)",
         "allreduce (sum) of M x N partial products", "2*(P-1)*M*N", ch01::row_parallel_matmul,
         2 * (p - 1) * MN, false, {P, 1}, {P, 0}, {1, 0}},
    };
    const float bound = matmul_reorder_bound(x, w);
    nlohmann::json& json = ctx.json();
    json["chapter"] = "01_matmul_split";
    json["shape"] = {{"M", M}, {"K", K}, {"N", N}};
    std::vector<std::string> table;
    int step = 1;
    for (const Strategy& s : strategies) {
      ctx.say("\n" + std::to_string(step++) + ". " + s.title + ": split " + s.splits);
      print(x, "x", s.x_view);
      print(w, "w", s.w_view);
      // What each rank holds and computes.
      std::ostringstream mine;
      if (std::string(s.key) == "data_parallel")
        mine << "x rows " << range_text(M, P, r) << " @ w -> out rows " << range_text(M, P, r);
      else if (std::string(s.key) == "column_parallel")
        mine << "x @ w columns " << range_text(N, P, r) << " -> out columns " << range_text(N, P, r);
      else
        mine << "x columns " << range_text(K, P, r) << " @ w rows " << range_text(K, P, r)
             << " -> a partial sum of all of out";
      ctx.say_each(mine.str());

      const Result res = measure(ctx, s, x, w, ref);
      print(res.out, "out after the " + std::string(s.collective), s.out_view);
      std::ostringstream line;
      line << "   max |out - reference| = " << format_number(res.max_abs_diff, 3);
      if (s.bitwise) line << (res.bitwise_equal ? " (bitwise equal)" : " (NOT bitwise equal)");
      else line << " (rounding bound " << format_number(bound, 3) << ")";
      line << "\n   communicated: " << res.total << " elements received in all (per rank: "
           << join(res.received) << "); formula " << s.formula_text << " = " << s.formula
           << (res.modeled ? "  [modeled: MPI hides its algorithm]" : "");
      ctx.say(line.str());

      const bool correct = s.bitwise ? res.bitwise_equal : res.max_abs_diff <= bound;
      ctx.verify(correct, std::string(s.title) + ": max abs diff " + format_number(res.max_abs_diff) +
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
    const float local_diff = max_abs_diff(grad, grad_ref);
    std::ostringstream g;
    g << "local dL/dw from rows " << range_text(M, P, r) << ": max |dW_r - dW| = "
      << format_number(local_diff, 3);
    ctx.say_each(g.str());
    // Do the ranks' gradients differ? Compare each with rank 0's.
    Tensor grad0 = grad;
    float spread = 0;
    {
      Communicator::Uncounted quiet(ctx.comm());
      ctx.comm().broadcast(grad0, 0);
      spread = max_abs_diff(grad, grad0);
      ctx.comm().allreduce(std::span<float>(&spread, 1), ReduceOp::max);
    }
    ctx.comm().allreduce(grad, ReduceOp::sum);  // what chapter 02 does every step
    float sum_diff = max_abs_diff(grad, grad_ref);
    {
      Communicator::Uncounted quiet(ctx.comm());
      ctx.comm().allreduce(std::span<float>(&sum_diff, 1), ReduceOp::max);
    }
    const float grad_bound = matmul_reorder_bound(transpose(x), ref);
    std::ostringstream b;
    b << "   the ranks' gradients differ by up to " << format_number(spread, 3)
      << ": a replica that stepped with its own would drift away from the others.\n"
      << "   sum over ranks (allreduce) vs single-device dL/dw: max abs diff "
      << format_number(sum_diff, 3) << " (rounding bound " << format_number(grad_bound, 3)
      << "): that sum is the gradient, and chapter 02 computes it every step.";
    ctx.say(b.str());
    ctx.verify(sum_diff <= grad_bound, "backward: the summed gradient is off by " +
                                           format_number(sum_diff) + " > bound " + format_number(grad_bound));
    ctx.verify(P == 1 || M < 2 || spread > 0, "backward: the ranks' gradients should differ");
    json["backward"] = {{"local_grads_max_spread", spread},
                        {"sum_max_abs_diff", sum_diff},
                        {"tolerance", grad_bound}};

    // -----------------------------------------------------------------------
    // 4. Summary.
    std::string summary = "\nSummary (elements received, summed over ranks)\n"
                          "  strategy                   measured    formula   max abs diff\n";
    for (const std::string& row : table) summary += row + "\n";
    ctx.say(summary);
  });
}

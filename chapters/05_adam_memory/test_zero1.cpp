// Chapter 05 tests of the learner's ZeRO-1 shard and step: compiled against the solution
// (must pass) and the exercise stub (every case must fail).
//
// References are computed here, independently: Adam as PyTorch's documentation writes it,
// in double (the library's nn::adam_update is checked on its own in test_nn.cpp); the
// ZeRO-1 step against plain Adam on the whole buffer with the gradients summed over ranks,
// for world sizes 1..8 and buffers that do not divide evenly; the shard's bytes against
// what stage 1 keeps, by ledger category.
//
// Wrong versions these tests were checked against (each fails with the message quoted):
//   make_shard copying the range into a new master in fp32 too
//     -> "world size 1, f32: in fp32 the master is a view of the parameters" and
//        "master holds 32 bytes in the ledger, want 0 (fp32: a view of the parameters)"
//   make_shard with m and v of the whole buffer
//     -> "world size 2, f32: m starts at 0: f32 [17] on host, expected f32 [9] on host"
//   make_shard counting m and v as master (the optimizer Scope's category mistyped)
//     -> "world size 1, f32: master holds 64 bytes in the ledger, want 0" and "optimizer
//        holds 0 bytes in the ledger, want 64"
//   make_shard with rank 0's range on every rank
//     -> "make_shard gave the range [0, 9), want [9, 17)"
//   the step not counted in zero1_step (t stays 1: the bias correction of step 1 every time)
//     -> "world size 1: master differs from plain Adam (max diff 0.0816342)" and
//        "after 4 steps the shard counts 0 Adam steps"
//   the gradient averaged (ReduceOp::avg) instead of summed: Adam's step barely sees the
//   scale (m / sqrt(v)), its state does
//     -> "world size 2: Adam's m differs from plain Adam's by 0.00272334 (is the gradient
//        the sum over ranks?)"
//   every rank reduces the whole buffer (an allreduce into a copy) and keeps its range
//     -> "rank 1 received 104 bytes in the step; a reduce-scatter and an all-gather of its
//        shard bring 68 (did every rank reduce or update the whole buffer?)" and
//        "allocated up to 68 bytes in the step; the shard is 8 elements"
//   the updated range sent without casting to the parameters' type (f16)
//     -> "Tensor::copy_from: f32 [8] on host into f16 [8] on host"
//   an all-gather of equal counts P / N (the uneven last shards dropped)
//     -> "rank 0: allgather: counts say 8 elements for this rank, but its buffer has 9"
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "shardlab/half.hpp"
#include "shardlab/memory.hpp"
#include "shardlab/testing.hpp"
#include "zero1.hpp"

using namespace shardlab;
using ch05::AdamConfig;
using memory::Category;
using shardlab::testing::on_ranks;

namespace {

/// Adam as PyTorch documents it (torch.optim.Adam / AdamW), in double.
struct Reference {
  AdamConfig c;
  std::vector<double> p, m, v;
  int t = 0;
  void step(const std::vector<double>& g) {
    ++t;
    const double c1 = 1 - std::pow(double(c.beta1), t), c2 = 1 - std::pow(double(c.beta2), t);
    for (std::size_t i = 0; i < p.size(); ++i) {
      double gi = g[i];
      if (c.decoupled)
        p[i] *= 1 - double(c.lr) * c.weight_decay;
      else
        gi += double(c.weight_decay) * p[i];
      m[i] = c.beta1 * m[i] + (1 - double(c.beta1)) * gi;
      v[i] = c.beta2 * v[i] + (1 - double(c.beta2)) * gi * gi;
      p[i] -= c.lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + c.eps);
    }
  }
};

std::vector<double> values(const Tensor& t) {
  const Tensor f = cast(t, DType::f32);
  return {f.begin(), f.end()};
}

/// max |a - b|; NaN anywhere gives NaN (so no comparison with a tolerance passes).
double worst(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double e = std::fabs(a[i] - b[i]);
    if (std::isnan(e)) return e;
    d = std::max(d, e);
  }
  return d;
}

/// Rank q's gradient of step t, element i: different on every rank, step and element.
float grad_value(int q, int t, std::int64_t i) {
  return static_cast<float>(std::sin(1.7 * q + 0.37 * t + 0.11 * static_cast<double>(i)) * (1 + q) *
                            0.01);
}

}  // namespace

TEST_SUITE("ch05") {
  TEST_CASE("make_shard keeps this rank's range only, each tensor in its ledger category") {
    for (int N : {1, 2, 3, 5})
      for (DType type : {DType::f32, DType::f16}) {
        const std::int64_t P = 9 * N - 1;  // uneven for every N > 1
        CAPTURE(N);
        CAPTURE(dtype_name(type));
        const Tensor init = cast(randn(Shape{P}, 13), type);
        on_ranks(N, [&](Communicator& comm) {
          Tensor params = init.clone();
          memory::Tracker tracker;
          const ch05::Shard shard = ch05::make_shard(comm, params, type);
          const ShardRange want = shard_range(P, N, comm.rank());
          CHECK_MESSAGE((shard.range.offset == want.offset && shard.range.length == want.length),
                        "make_shard gave the range ["
                            << shard.range.offset << ", " << shard.range.offset + shard.range.length
                            << "), want [" << want.offset << ", " << want.offset + want.length
                            << ")");
          const std::int64_t S = want.length;
          const std::string where =
              "world size " + std::to_string(N) + ", " + std::string(dtype_name(type));
          // The master holds the range's values in f32, exactly (f16 -> f32 is exact).
          shardlab::testing::check_equal(shard.master, cast(init.slice(want.offset, S), DType::f32),
                                         where + ": master = this rank's range, in f32");
          if (type == DType::f32)
            CHECK_MESSAGE(shard.master.shares_memory_with(params),
                          where << ": in fp32 the master is a view of the parameters");
          shardlab::testing::check_equal(shard.m, zeros(Shape{S}), where + ": m starts at 0");
          shardlab::testing::check_equal(shard.v, zeros(Shape{S}), where + ": v starts at 0");
          CHECK_MESSAGE((shard.grad.size() == S && shard.grad.dtype() == type),
                        where << ": grad is " << shard.grad.describe());
          CHECK_MESSAGE((shard.send.size() == S && shard.send.dtype() == type),
                        where << ": send is " << shard.send.describe());
          CHECK_MESSAGE(shard.step == 0, "a new shard has taken " << shard.step << " steps");
          // What stage 1 keeps, by category: 4 S of master (mixed only), 8 S of m and v, a
          // gradient and a send buffer of the range.
          const memory::Usage u = tracker.usage();
          const auto bytes = [&](std::int64_t n) { return static_cast<std::uint64_t>(n); };
          const std::uint64_t w = dtype_size(type);
          const std::pair<Category, std::uint64_t> want_bytes[] = {
              {Category::master, type == DType::f32 ? 0 : 4 * bytes(S)},
              {Category::optimizer, 8 * bytes(S)},
              {Category::comm, 2 * w * bytes(S)}};
          for (const auto& [category, expect] : want_bytes)
            CHECK_MESSAGE(u.live(category) == expect,
                          where << ": " << std::string(memory::category_name(category)) << " holds "
                                << u.live(category) << " bytes in the ledger, want " << expect
                                << std::string(category == Category::master && type == DType::f32
                                                   ? " (fp32: a view of the parameters)"
                                                   : ""));
          CHECK_MESSAGE(u.live_total == u.live(Category::master) + u.live(Category::optimizer) +
                                            u.live(Category::comm),
                        where << ": " << u.live_total << " bytes in all, some outside the "
                              << "master, optimizer and comm categories");
        });
      }
  }

  TEST_CASE(
      "zero1_step equals plain Adam on the summed gradients, every world size, uneven shards") {
    for (int N : {1, 2, 3, 4, 5, 8})
      for (DType type : {DType::f32, DType::f16}) {
        const std::int64_t P = 9 * N - 1;  // uneven for every N > 1: P % N = N - 1
        CAPTURE(N);
        CAPTURE(dtype_name(type));
        const AdamConfig config{.lr = 0.05f, .weight_decay = 0.01f, .decoupled = true};
        // Plain Adam, in double, on the whole buffer with every rank's gradient summed.
        const Tensor init = cast(randn(Shape{P}, 11), type);
        Reference ref{config, values(init), std::vector<double>(P), std::vector<double>(P), 0};
        for (int t = 1; t <= 4; ++t) {
          std::vector<double> g(P, 0.0);
          for (std::int64_t i = 0; i < P; ++i) {
            float sum = 0;  // the threads backend sums in f32, in rank order, rounding once
            for (int q = 0; q < N; ++q)
              sum += type == DType::f16 ? to_float(from_float<Half>(grad_value(q, t, i)))
                                        : grad_value(q, t, i);
            g[static_cast<std::size_t>(i)] =
                type == DType::f16 ? to_float(from_float<Half>(sum)) : static_cast<double>(sum);
          }
          ref.step(g);
        }
        on_ranks(N, [&](Communicator& comm) {
          Tensor params = init.clone();
          ch05::Shard shard = ch05::make_shard(comm, params, type);
          const ShardRange want = shard_range(P, N, comm.rank());
          CHECK_MESSAGE((shard.range.offset == want.offset && shard.range.length == want.length),
                        "make_shard gave the wrong range");
          for (int t = 1; t <= 4; ++t) {
            Tensor g(P);
            for (std::int64_t i = 0; i < P; ++i) g[i] = grad_value(comm.rank(), t, i);
            const Tensor grads = cast(g, type);
            memory::Tracker step_memory;
            const CommStats before = comm.stats();
            ch05::zero1_step(comm, params, grads, shard, config);
            const OpStats moved = comm.stats().since(before).total();
            const memory::Usage u = step_memory.usage();
            // A reduce-scatter reads this rank's shard from the N - 1 others; an
            // all-gather brings in everyone else's range: (N-1) S + (P - S) elements.
            const std::uint64_t elem = dtype_size(type);
            const std::uint64_t S = static_cast<std::uint64_t>(want.length);
            const std::uint64_t expect = elem * ((N - 1) * S + (static_cast<std::uint64_t>(P) - S));
            CHECK_MESSAGE(
                moved.bytes_received == expect,
                "rank " << comm.rank() << " received " << moved.bytes_received
                        << " bytes in the step; a reduce-scatter and an all-gather of its shard "
                        << "bring " << expect
                        << (moved.bytes_received > expect
                                ? " (did every rank reduce or update the whole buffer?)"
                                : " (a collective left out, or a shard that is not this "
                                  "rank's: reduce-scatter the gradients, all-gather the "
                                  "updated ranges)"));
            CHECK_MESSAGE(u.live_total == 0,
                          "rank " << comm.rank() << " kept " << u.live_total
                                  << " bytes after the step: the state lives in the Shard");
            CHECK_MESSAGE(u.peak_total <= 4 * S,
                          "rank " << comm.rank() << " allocated up to " << u.peak_total
                                  << " bytes in the step; the shard is " << S
                                  << " elements: nothing the size of the whole buffer");
          }
          // The gathered masters against the reference, and the params equal to them.
          Tensor all(P);
          comm.allgatherv(shard.master, all, shard_counts(P, N));
          const double d = worst(values(all), ref.p);
          CHECK_MESSAGE(d < 1e-5, "world size "
                                      << N << ": master differs from plain Adam (max diff " << d
                                      << ")");
          // Adam barely sees a gradient's scale (m / sqrt(v)): its state does.
          Tensor all_m(P), all_v(P);
          comm.allgatherv(shard.m, all_m, shard_counts(P, N));
          comm.allgatherv(shard.v, all_v, shard_counts(P, N));
          const double dm = worst(values(all_m), ref.m), dv = worst(values(all_v), ref.v);
          CHECK_MESSAGE(dm < 1e-7, "world size " << N << ": Adam's m differs from plain Adam's by "
                                                 << dm << " (is the gradient the sum over ranks?)");
          CHECK_MESSAGE(dv < 1e-9,
                        "world size " << N << ": Adam's v differs from plain Adam's by " << dv);
          CHECK_MESSAGE(shard.step == 4,
                        "after 4 steps the shard counts " << shard.step << " Adam steps");
          shardlab::testing::check_equal(
              params, cast(all, type),
              "every rank's params: the gathered masters, in the parameters' type");
        });
      }
  }
}

// Chapter 05 tests of the learner's Adam update and ZeRO-1 step: compiled against the
// solution (must pass) and the exercise stub (every case must fail).
//
// References are computed here, independently: Adam as PyTorch's documentation writes it,
// in double, and a hand-worked sequence of three steps; the ZeRO-1 step against plain
// Adam on the whole buffer with the gradients summed over ranks, for world sizes 1..8 and
// buffers that do not divide evenly.
//
// Wrong versions these tests were checked against (each fails with the message quoted):
//   no bias correction (c1 = c2 = 1)
//     -> "Adam step 1 ... step 1: master is 0.68377, the hand-worked value 0.9"
//   the step not counted in zero1_step (t stays 1: the bias correction of step 1 every time)
//     -> "world size 1: master differs from plain Adam (max diff 0.0816342)" and
//        "after 4 steps the shard counts 0 Adam steps"
//   AdamW's decay left out, or added to the gradient as Adam's L2 does
//     -> "AdamW step 1: master is ..., the hand-worked value 0.890000002"
//   epsilon inside the square root
//     -> "Adam: after 20 steps master differs from PyTorch's rule by 0.0763461"
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
using shardlab::testing::on_ranks;
using ch05::AdamConfig;

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
  return static_cast<float>(std::sin(1.7 * q + 0.37 * t + 0.11 * static_cast<double>(i)) *
                            (1 + q) * 0.01);
}

}  // namespace

TEST_SUITE("ch05") {
  TEST_CASE("adam_update follows a hand-worked sequence of three steps") {
    // p = 1, gradients 0.5, -0.25, 1; lr 0.1, betas 0.9 / 0.999, eps 1e-8. Step 1:
    // m = 0.05, v = 0.00025, m^ = 0.5, v^ = 0.25, p = 1 - 0.1 * 0.5 / (0.5 + 1e-8).
    struct Expected {
      const char* name;
      AdamConfig config;
      double p[3], m[3], v[3];
    };
    const Expected cases[] = {
        {"Adam", {.lr = 0.1f},
         {0.900000002, 0.873366299, 0.807555140}, {0.05, 0.02, 0.118},
         {0.00025, 0.00031225, 0.00131193775}},
        {"AdamW", {.lr = 0.1f, .weight_decay = 0.1f, .decoupled = true},
         {0.890000002, 0.854466299, 0.780110477}, {0.05, 0.02, 0.118},
         {0.00025, 0.00031225, 0.00131193775}},
        {"Adam with L2", {.lr = 0.1f, .weight_decay = 0.1f},
         {0.900000002, 0.854441367, 0.781504400}, {0.06, 0.038, 0.142744414},
         {0.00036, 0.00038524, 0.00156304373}},
    };
    const float grads[3] = {0.5f, -0.25f, 1.0f};
    for (const Expected& e : cases) {
      const std::string name = e.name;
      CAPTURE(name);
      Tensor master = Tensor::from_1d({1.0f}), m(1), v(1);
      for (int t = 1; t <= 3; ++t) {
        ch05::adam_update(master, Tensor::from_1d({grads[t - 1]}), m, v, t, e.config);
        INFO(name << " step " << t);
        CHECK_MESSAGE(std::fabs(master[0] - e.p[t - 1]) < 2e-6,
                      "step " << t << ": master is " << master[0] << ", the hand-worked value "
                              << e.p[t - 1]);
        CHECK_MESSAGE(std::fabs(m[0] - e.m[t - 1]) <= 1e-6 * std::fabs(e.m[t - 1]), "step " << t << ": m is " << m[0] << ", the hand-worked value " << e.m[t - 1]);
        // 1 - beta2 = 0.001 is 0.00099998713 in f32: v is off by that much, relatively.
        CHECK_MESSAGE(std::fabs(v[0] - e.v[t - 1]) <= 3e-5 * e.v[t - 1], "step " << t << ": v is " << v[0] << ", the hand-worked value " << e.v[t - 1]);
      }
    }
  }

  TEST_CASE("Adam, Adam with L2 and AdamW follow PyTorch's rule over many elements and steps") {
    const std::int64_t n = 257;
    for (const AdamConfig& c : {AdamConfig{.lr = 0.01f}, AdamConfig{.lr = 0.01f, .weight_decay = 0.05f},
                                AdamConfig{.lr = 0.01f, .weight_decay = 0.05f, .decoupled = true}}) {
      Tensor master = randn(Shape{n}, 5), m(n), v(n);
      Reference ref{c, values(master), std::vector<double>(n), std::vector<double>(n), 0};
      for (int t = 1; t <= 20; ++t) {
        Tensor g(n);
        for (std::int64_t i = 0; i < n; ++i) g[i] = grad_value(0, t, i) * (i % 7 == 0 ? 1e-4f : 1.0f);
        ref.step(values(g));
        ch05::adam_update(master, g, m, v, t, c);
      }
      const double d = worst(values(master), ref.p);
      const std::string variant = c.weight_decay == 0 ? "Adam" : c.decoupled ? "AdamW" : "Adam with L2";
      CHECK_MESSAGE(d < 1e-5, variant << ": after 20 steps master differs from PyTorch's rule by " << d);
      CHECK_MESSAGE(worst(values(m), ref.m) < 1e-7, "m differs from PyTorch's rule");
      CHECK_MESSAGE(worst(values(v), ref.v) < 1e-8, "v differs from PyTorch's rule");
    }
  }

  TEST_CASE("adam_update reads f16 gradients as the floats they hold") {
    const std::int64_t n = 64;
    Tensor g16 = cast(scale(randn(Shape{n}, 9), 0.01f), DType::f16);
    Tensor g32 = cast(g16, DType::f32);
    Tensor a = randn(Shape{n}, 3), b = a.clone(), ma(n), va(n), mb(n), vb(n);
    for (int t = 1; t <= 3; ++t) {
      ch05::adam_update(a, g16, ma, va, t, {});
      ch05::adam_update(b, g32, mb, vb, t, {});
    }
    shardlab::testing::check_equal(a, b, "master from f16 gradients vs the same values in f32");
  }

  TEST_CASE("zero1_step equals plain Adam on the summed gradients, every world size, uneven shards") {
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
              sum += type == DType::f16 ? to_float(from_float<Half>(grad_value(q, t, i))) : grad_value(q, t, i);
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
            CHECK_MESSAGE(moved.bytes_received == expect,
                          "rank " << comm.rank() << " received " << moved.bytes_received
                                  << " bytes in the step; a reduce-scatter and an all-gather of its shard bring "
                                  << expect << " (did every rank reduce or update the whole buffer?)");
            CHECK_MESSAGE(u.live_total == 0, "rank " << comm.rank() << " kept " << u.live_total
                                                     << " bytes after the step: the state lives in the Shard");
            CHECK_MESSAGE(u.peak_total <= 4 * S, "rank " << comm.rank() << " allocated up to " << u.peak_total
                                                         << " bytes in the step; the shard is " << S
                                                         << " elements: nothing the size of the whole buffer");
          }
          // The gathered masters against the reference, and the params equal to them.
          Tensor all(P);
          comm.allgatherv(shard.master, all, shard_counts(P, N));
          const double d = worst(values(all), ref.p);
          CHECK_MESSAGE(d < 1e-5, "world size " << N << ": master differs from plain Adam (max diff " << d << ")");
          // Adam barely sees a gradient's scale (m / sqrt(v)): its state does.
          Tensor all_m(P), all_v(P);
          comm.allgatherv(shard.m, all_m, shard_counts(P, N));
          comm.allgatherv(shard.v, all_v, shard_counts(P, N));
          const double dm = worst(values(all_m), ref.m), dv = worst(values(all_v), ref.v);
          CHECK_MESSAGE(dm < 1e-7, "world size " << N << ": Adam's m differs from plain Adam's by " << dm
                                                 << " (is the gradient the sum over ranks?)");
          CHECK_MESSAGE(dv < 1e-9, "world size " << N << ": Adam's v differs from plain Adam's by " << dv);
          CHECK_MESSAGE(shard.step == 4, "after 4 steps the shard counts " << shard.step << " Adam steps");
          shardlab::testing::check_equal(params, cast(all, type),
                                         "every rank's params: the gathered masters, in the parameters' type");
        });
      }
  }
}

// Chapter 07's MoE layer as a part of other models: inside an nn::Sequential between
// Linear and LayerNorm layers, and with two micro-batches in flight, on 2-4 ranks, against
// the same model on one device built from independent parts (nn::Linear, nn::LayerNorm and
// the written-out moe_reference). Plus the pairwise all-to-all and the byte formula, and the
// layer as chapter 09's GPT uses it: routing groups with the aux loss weighed (against
// finite differences of the objective written out in double), a group split over ranks.
//
// Wrong versions this test was checked against (each fails the case named, with the
// message quoted):
//   the router's gradient not summed over the ranks (no allreduce in backward_weight)
//     -> "in a model": "dL/dWrouter: 64 of 64 elements differ"; "micro-batches":
//     "dL/dWrouter after two micro-batches";
//   the accumulated gradient allreduced (grad += x^T dlogits, then allreduce(grad), which
//     sums the first micro-batch's N times) -> "micro-batches": "dL/dWrouter after two
//     micro-batches";
//   backward_weight assigning the experts' gradients instead of adding to them
//     -> "micro-batches": "dL/dW1 of expert e after two micro-batches";
//   dL/dy sent to the experts without its gate (dout = dy) -> "in a model": "dL/dx: 55 of
//     60 elements differ", "dL/dW1 of expert e";
//   a rank's aux-loss gradient over its own T_r tokens (alpha E f_i / T_r, as if each
//     rank's aux loss counted in full) instead of its share of the batch's (/ T)
//     -> "in a model" and "no tokens": "dL/dWrouter: 64 of 64 elements differ";
//   pairwise_alltoallv: its own block not copied, the last step (s = N - 1) skipped
//     -> "block from rank q"; receive offsets taken from the send counts -> the rank's
//     error "Tensor::slice: 0..2 along dimension 0 of [1]";
//   formula_alltoall_bytes: the combine left out -> "rank 0: the formula says 624 bytes,
//     the plan receives 1200"; the backward left out (x 1, not x 2) -> the same; dropped
//     choices counted -> "the formula says 1584 bytes"; the exchange of counts left out
//     -> "the formula says 1152 bytes, the plan receives 1200".
//   grouped routing (a model's MLP): the aux loss's gradient not weighed (MoeLog::weight
//     left out) -> "dL/dWr differs from the finite differences by 0.00803" (2.8e-7 right);
//     a split group's f_i from the rank's own tokens, not the whole group's -> "dL/dx of
//     this rank's tokens: 48 of 72 elements differ".
// (The order in which an expert runs its rows, and where the receive buffer puts them, are
// the exercise's: test_routing.cpp.)
#include <doctest/doctest.h>

#include <cmath>
#include <memory>

#include "combine.hpp"
#include "moe.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::check_close;
using shardlab::testing::check_equal;
using shardlab::testing::on_ranks;

namespace {

ch07::MoeConfig model_config() {
  ch07::MoeConfig c;
  c.tokens = 23;  // uneven shares on 2, 3 and 4 ranks
  c.hidden = 8;
  c.ffn = 12;
  c.experts = 12;
  c.k = 2;
  c.capacity_factor = 0.9;  // some choices dropped
  c.aux_alpha = 0.05;
  c.seed = 3;
  return c;
}

// Input features, output features of the model around the layer.
constexpr std::int64_t in_features = 5, out_features = 3;

/// The model on one device, from independent parts: Linear, then moe_reference, then
/// LayerNorm, then Linear; forward and backward by hand.
struct OneDevice {
  Tensor y, dx;            // every token's
  ch07::Result moe;        // the MoE part's backward: its dx, router and experts' grads
  std::vector<Tensor> dp;  // the gradients of in, norm, out: weight, bias, gamma, beta, ...
};
OneDevice one_device(const ch07::MoeConfig& c, const Tensor& x, const Tensor& dy, int ranks) {
  nn::ParameterStore store;
  nn::Linear in(store, "in", in_features, c.hidden, 51);
  nn::LayerNorm norm(store, "norm", c.hidden);
  nn::Linear out(store, "out", c.hidden, out_features, 52);
  store.allocate();
  const ch07::Weights weights = ch07::make_weights(c, 0, c.experts);
  nn::Forward h = in.forward(x);
  const ch07::Result moe_y = ch07::moe_reference(c, weights, h.out, Tensor(), ranks);
  nn::Forward n = norm.forward(moe_y.y);
  nn::Forward o = out.forward(n.out);
  OneDevice r;
  r.y = o.out;
  const Tensor dmoe = norm.backward(out.backward(dy, o.saved), n.saved);
  r.moe = ch07::moe_reference(c, weights, h.out, dmoe, ranks);
  r.dx = in.backward(r.moe.dx, h.saved);
  for (nn::Parameter* p : store.parameters()) r.dp.push_back(p->grad.clone());
  return r;
}

}  // namespace

TEST_SUITE("ch07") {
  TEST_CASE("the MoE layer in a model (Linear, MoE, LayerNorm, Linear) equals one device") {
    const ch07::MoeConfig c = model_config();
    const Tensor x = randn(Shape{c.tokens, in_features}, 41);
    const Tensor dy = randn(Shape{c.tokens, out_features}, 42);
    for (int N : {2, 3, 4}) {
      CAPTURE(N);
      const OneDevice ref = one_device(c, x, dy, N);
      on_ranks(N, [&](Communicator& comm) {
        // [moe_in_a_model]
        nn::ParameterStore store;
        nn::Sequential model;
        nn::Linear& in = model.add<nn::Linear>(store, "in", in_features, c.hidden, 51);
        ch07::MoeLayer& moe = model.add<ch07::MoeLayer>(store, comm, c);
        nn::LayerNorm& norm = model.add<nn::LayerNorm>(store, "norm", c.hidden);
        nn::Linear& out = model.add<nn::Linear>(store, "out", c.hidden, out_features, 52);
        store.allocate();
        const ShardRange mine = shard_range(c.tokens, N, comm.rank());
        nn::Forward f = model.forward(x.slice(mine.offset, mine.length));
        check_equal(f.out, ref.y.slice(mine.offset, mine.length), "outputs");
        const Tensor dx = model.backward(dy.slice(mine.offset, mine.length), f.saved);
        // [moe_in_a_model]
        check_equal(dx, ref.dx.slice(mine.offset, mine.length), "dL/dx");
        check_close(moe.router().grad, ref.moe.drouter, 1e-6f, 1e-5f, "dL/dWrouter");
        for (int l = 0; l < moe.experts_here(); ++l) {
          const auto e = static_cast<std::size_t>(moe.first_expert() + l);
          CAPTURE(e);
          check_equal(moe.w1(l).grad, ref.moe.dw1[e], "dL/dW1 of expert e");
          check_equal(moe.w2(l).grad, ref.moe.dw2[e], "dL/dW2 of expert e");
        }
        // The layers around it are data parallel: their gradients are this rank's tokens'
        // share, and summed over the ranks they are one device's (to rounding).
        std::vector<nn::Parameter*> around;
        for (nn::Layer* layer : {static_cast<nn::Layer*>(&in), static_cast<nn::Layer*>(&norm),
                                 static_cast<nn::Layer*>(&out)})
          for (nn::Parameter* p : layer->parameters()) around.push_back(p);
        REQUIRE(around.size() == ref.dp.size());
        for (std::size_t i = 0; i < around.size(); ++i) {
          Tensor summed = around[i]->grad.clone();
          comm.allreduce(summed);
          check_close(summed, ref.dp[i], 1e-5f, 1e-5f, "dL/d" + around[i]->name);
        }
      });
    }
  }

  TEST_CASE("two micro-batches in flight (F F B B, W W) add up their gradients") {
    ch07::MoeConfig c = model_config();
    const ch07::Weights all = ch07::make_weights(c, 0, c.experts);
    const Tensor xa = randn(Shape{c.tokens, c.hidden}, 61),
                 dya = randn(Shape{c.tokens, c.hidden}, 62);
    const Tensor xb = randn(Shape{c.tokens, c.hidden}, 63),
                 dyb = randn(Shape{c.tokens, c.hidden}, 64);
    for (int N : {2, 4}) {
      CAPTURE(N);
      const ch07::Result a = ch07::moe_reference(c, all, xa, dya, N),
                         b = ch07::moe_reference(c, all, xb, dyb, N);
      on_ranks(N, [&](Communicator& comm) {
        nn::ParameterStore store;
        ch07::MoeLayer moe(store, comm, c);
        store.allocate();
        const ShardRange mine = shard_range(c.tokens, N, comm.rank());
        auto share = [&](const Tensor& t) { return t.slice(mine.offset, mine.length); };
        nn::Forward fa = moe.forward(share(xa));
        nn::Forward fb = moe.forward(share(xb));
        check_equal(fa.out, share(a.y), "outputs of micro-batch a");
        check_equal(fb.out, share(b.y), "outputs of micro-batch b");
        check_equal(moe.backward_input(share(dyb), fb.saved), share(b.dx),
                    "dL/dx of micro-batch b");
        check_equal(moe.backward_input(share(dya), fa.saved), share(a.dx),
                    "dL/dx of micro-batch a");
        moe.backward_weight(fa.saved);
        moe.backward_weight(fb.saved);
        check_close(moe.router().grad, add(a.drouter, b.drouter), 1e-6f, 1e-5f,
                    "dL/dWrouter after two micro-batches");
        for (int l = 0; l < moe.experts_here(); ++l) {
          const auto e = static_cast<std::size_t>(moe.first_expert() + l);
          CAPTURE(e);
          check_equal(moe.w1(l).grad, add(a.dw1[e], b.dw1[e]),
                      "dL/dW1 of expert e after two micro-batches");
          check_equal(moe.w2(l).grad, add(a.dw2[e], b.dw2[e]),
                      "dL/dW2 of expert e after two micro-batches");
        }
        CHECK_THROWS_WITH_AS(moe.backward_weight(fa.saved),
                             doctest::Contains("backward_input first"), Error);
      });
    }
  }

  TEST_CASE("pairwise all-to-all(v) moves what the backend's alltoallv moves, uneven blocks") {
    for (int N : {1, 2, 3, 4}) {
      CAPTURE(N);
      on_ranks(N, [&](Communicator& comm) {
        const int r = comm.rank();
        // Rank r sends (r + 2 q + 1) % 3 elements to rank q (its own block never empty,
        // some others empty): element i of the block for q is 1000 r + 100 q + i.
        std::vector<std::size_t> send(static_cast<std::size_t>(N)), recv(send);
        std::vector<float> values;
        for (int q = 0; q < N; ++q) {
          send[static_cast<std::size_t>(q)] = static_cast<std::size_t>((r + 2 * q + 1) % 3);
          recv[static_cast<std::size_t>(q)] = static_cast<std::size_t>((q + 2 * r + 1) % 3);
          for (std::size_t i = 0; i < send[static_cast<std::size_t>(q)]; ++i)
            values.push_back(static_cast<float>(1000 * r + 100 * q) + static_cast<float>(i));
        }
        const Tensor in = Tensor::from_vector(values);
        std::int64_t total = 0;
        for (auto n : recv) total += static_cast<std::int64_t>(n);
        Tensor got(total), want(total);
        ch07::pairwise_alltoallv(comm, in, send, got, recv);
        comm.alltoallv(in, send, want, recv);
        std::int64_t at = 0;
        for (int q = 0; q < N; ++q) {
          CAPTURE(q);
          const auto n = static_cast<std::int64_t>(recv[static_cast<std::size_t>(q)]);
          check_equal(got.slice(at, n), want.slice(at, n), "block from rank q");
          for (std::int64_t i = 0; i < n; ++i)
            CHECK(want[at + i] == static_cast<float>(1000 * q + 100 * r + i));  // the oracle
          at += n;
        }
      });
    }
  }

  TEST_CASE("the byte formula: what each rank's plan receives, and what the layer moved") {
    for (int N : {2, 3, 4}) {
      CAPTURE(N);
      ch07::MoeConfig c = model_config();
      const Tensor x = randn(Shape{c.tokens, c.hidden}, 71),
                   dy = randn(Shape{c.tokens, c.hidden}, 72);
      const ch07::Result ref =
          ch07::moe_reference(c, ch07::make_weights(c, 0, c.experts), x, dy, N);
      REQUIRE(ref.stats.dropped > 0);  // a dropped choice must travel nowhere
      on_ranks(N, [&](Communicator& comm) {
        const int per = c.experts / N, r = comm.rank();
        // From every rank's plan: the rows other ranks send here (the dispatch) and the
        // rows this rank sends elsewhere (coming back in the combine), each a row of d
        // floats, forward and backward; and E/N counts of 8 bytes from every other rank.
        std::uint64_t rows = 0;
        for (int q = 0; q < N; ++q)
          if (q != r)
            rows += ch07::plan_dispatch(ref.routings[static_cast<std::size_t>(q)], N)
                        .send_counts[static_cast<std::size_t>(r)] +
                    ch07::plan_dispatch(ref.routings[static_cast<std::size_t>(r)], N)
                        .send_counts[static_cast<std::size_t>(q)];
        const std::uint64_t want = 2 * rows * static_cast<std::uint64_t>(c.hidden) * 4 +
                                   static_cast<std::uint64_t>((N - 1) * per) * 8;
        CHECK_MESSAGE(ch07::formula_alltoall_bytes(ref.routings, r, N, c.hidden) == want,
                      "rank " << r << ": the formula says "
                              << ch07::formula_alltoall_bytes(ref.routings, r, N, c.hidden)
                              << " bytes, the plan receives " << want);
        const ShardRange mine = shard_range(c.tokens, N, r);
        const ch07::Result got = ch07::moe_parallel(
            comm, c, ch07::make_weights(c, r * per, per), x.slice(mine.offset, mine.length),
            dy.slice(mine.offset, mine.length), Memory::host);
        CHECK_MESSAGE(got.alltoall_received == want, "rank " << r << " received "
                                                             << got.alltoall_received
                                                             << " bytes, the plan " << want);
      });
    }
  }
}

// ---------------------------------------------------------------------------
// The layer as a model's MLP (chapter 09's GPT): routing groups, no residual, the aux loss
// weighed, the experts in a store of their own, a group split over ranks.

namespace {

constexpr int kGroupTokens = 8, kGroups = 3;

ch07::MoeConfig grouped_config() {
  ch07::MoeConfig c;
  c.tokens = 0;  // unused: the groups say how many
  c.hidden = 6;
  c.ffn = 6;
  c.experts = 4;
  c.k = 2;
  c.capacity_factor = 0.75;  // 3 slots an expert a group: some choices dropped
  c.aux_alpha = 0.1;
  c.seed = 9;
  return c;
}

/// Expert e: y = x A_e (d x d, no bias), from its own seed.
Tensor expert_weight(int e) {
  return scale(randn(Shape{6, 6}, 500 + static_cast<std::uint64_t>(e)), 0.4f);
}

ch07::MoeOptions grouped_options(std::shared_ptr<ch07::MoeLog> log,
                                 nn::ParameterStore* expert_store) {
  ch07::MoeOptions o;
  o.name = "mlp";
  o.residual = false;
  o.sum_router = false;
  o.expert_store = expert_store;
  o.expert = [](nn::ParameterStore& store, int e) {
    auto net = std::make_shared<nn::Sequential>();
    net->add<nn::Linear>(store, "mlp.expert" + std::to_string(e), 6, 6, 0, false)
        .weight()
        .value.copy_from(expert_weight(e));
    return std::shared_ptr<nn::Layer>(std::move(net));
  };
  o.groups.tokens = kGroupTokens;
  o.log = std::move(log);
  return o;
}

/// The layer's objective, in double, written out here from the definitions: L = sum of
/// w . y over the tokens, y_t = sum over t's kept choices of gate x expert(x_t), plus each
/// group's aux loss alpha E sum_i f_i P_i times `weight`. The routing (which choices are
/// kept) is given; the gates and P follow the router's weights Wr, so L is smooth in Wr
/// around them.
double grouped_objective(const ch07::MoeConfig& c, const Tensor& x, const Tensor& w,
                         const Tensor& router, const ch07::Routing& r, double weight) {
  const std::int64_t d = c.hidden, E = c.experts;
  double L = 0;
  for (int g = 0; g < kGroups; ++g) {
    std::vector<double> P(static_cast<std::size_t>(E), 0.0), f(P.size(), 0.0);
    for (int i = 0; i < kGroupTokens; ++i) {
      const int t = g * kGroupTokens + i;
      std::vector<double> p(static_cast<std::size_t>(E));
      double top = -1e300, sum = 0;
      for (std::int64_t e = 0; e < E; ++e) {
        double z = 0;
        for (std::int64_t k = 0; k < d; ++k) z += double(x(t, k)) * router(k, e);
        top = std::max(top, p[static_cast<std::size_t>(e)] = z);
      }
      for (double& v : p) sum += v = std::exp(v - top);
      for (double& v : p) v /= sum;
      double chosen = 0;
      for (int j = 0; j < c.k; ++j) chosen += p[static_cast<std::size_t>(r.expert[r.at(t, j)])];
      for (int j = 0; j < c.k; ++j) {
        const int e = r.expert[r.at(t, j)];
        if (r.slot[r.at(t, j)] < 0) continue;
        const Tensor A = expert_weight(e);
        const double gate = p[static_cast<std::size_t>(e)] / chosen;
        for (std::int64_t o = 0; o < d; ++o) {
          double out = 0;
          for (std::int64_t k = 0; k < d; ++k) out += double(x(t, k)) * A(k, o);
          L += gate * out * w(t, o);
        }
      }
      for (std::int64_t e = 0; e < E; ++e)
        P[static_cast<std::size_t>(e)] += p[static_cast<std::size_t>(e)] / kGroupTokens;
      f[static_cast<std::size_t>(r.expert[r.at(t, 0)])] += 1.0 / kGroupTokens;
    }
    double aux = 0;
    for (std::int64_t e = 0; e < E; ++e)
      aux += f[static_cast<std::size_t>(e)] * P[static_cast<std::size_t>(e)];
    L += weight * c.aux_alpha * static_cast<double>(E) * aux;
  }
  return L;
}

}  // namespace

TEST_CASE(
    "grouped routing: each group with its own capacity; its aux loss weighed into the "
    "router's gradient (finite differences)") {
  const ch07::MoeConfig c = grouped_config();
  const Tensor x = randn(kGroups * kGroupTokens, c.hidden, 41), w = randn(x.rows(), c.hidden, 42);
  const Tensor router = scale(randn(Shape{c.hidden, c.experts}, 43), 0.8f);
  constexpr double kWeight = 0.5;
  on_ranks(1, [&](Communicator& comm) {
    nn::ParameterStore store, experts;
    auto log = std::make_shared<ch07::MoeLog>();
    log->weight = kWeight;
    ch07::MoeLayer layer(store, comm, c, router, grouped_options(log, &experts));
    store.allocate();
    experts.allocate();
    CHECK(store.parameters().size() == 1);  // the router; the experts are in their own store
    CHECK(experts.parameters().size() == static_cast<std::size_t>(c.experts));
    nn::Forward f = layer.forward(x);
    const ch07::Routing r = layer.routing(f.saved);
    // Each group routed alone: route() of its own tokens' probabilities, its capacity
    // ceil(k T / E x factor) = 3.
    const Tensor probs = ch07::router_probs(x, router);
    int dropped = 0;
    for (int g = 0; g < kGroups; ++g) {
      const ch07::Routing alone = ch07::route(probs.slice(g * kGroupTokens, kGroupTokens), c.k, 3);
      for (int t = 0; t < kGroupTokens; ++t)
        for (int j = 0; j < c.k; ++j) {
          const int ch = alone.at(t, j), whole = r.at(g * kGroupTokens + t, j);
          CHECK_MESSAGE(
              r.expert[static_cast<std::size_t>(whole)] ==
                  alone.expert[static_cast<std::size_t>(ch)],
              "group " << g << ", token " << t << ": another expert than its group's own routing");
          CHECK_MESSAGE((r.slot[static_cast<std::size_t>(whole)] < 0) ==
                            (alone.slot[static_cast<std::size_t>(ch)] < 0),
                        "group " << g << ", token " << t << ", choice " << j
                                 << ": dropped or kept unlike its group's own routing");
          dropped += alone.slot[static_cast<std::size_t>(ch)] < 0;
        }
    }
    REQUIRE(dropped > 0);
    // The objective's y part: no residual.
    double yw = 0;
    for (std::int64_t t = 0; t < x.rows(); ++t)
      for (std::int64_t o = 0; o < c.hidden; ++o) yw += double(f.out(t, o)) * w(t, o);
    const double L0 = grouped_objective(c, x, w, router, r, kWeight);
    double aux_alone = 0;  // L0 less its y part: the weighed aux losses
    aux_alone = L0 - yw;
    layer.backward(w, f.saved);
    CHECK(log->stats.dropped == dropped);
    CHECK(std::abs(log->stats.aux_loss - aux_alone) < 1e-6 * std::max(1.0, aux_alone));
    // dL/dWr against central differences of the objective, the routing held.
    const Tensor grad = layer.router().grad;
    double worst = 0;
    for (std::int64_t k = 0; k < c.hidden; ++k)
      for (std::int64_t e = 0; e < c.experts; ++e) {
        constexpr double h = 1e-4;
        Tensor up = router.clone(), down = router.clone();
        up(k, e) += static_cast<float>(h);
        down(k, e) -= static_cast<float>(h);
        const double dh = double(up(k, e)) - double(down(k, e));
        const double numeric = (grouped_objective(c, x, w, up, r, kWeight) -
                                grouped_objective(c, x, w, down, r, kWeight)) /
                               dh;
        worst = std::max(worst, std::abs(numeric - grad(k, e)) / std::max(1.0, std::abs(numeric)));
      }
    CHECK_MESSAGE(worst < 1e-5, "dL/dWr differs from the finite differences by " << worst);
  });
}

TEST_CASE("a group split over ranks routes as it does whole, each rank its own tokens") {
  // Two ranks each hold half of every group (the zigzag's chunks: rank 0 positions 0, 1, 6,
  // 7; rank 1 positions 2 .. 5), as chapter 10's context parallelism cuts a sequence.
  const ch07::MoeConfig c = grouped_config();
  const Tensor x = randn(kGroups * kGroupTokens, c.hidden, 51), w = randn(x.rows(), c.hidden, 52);
  const Tensor router = scale(randn(Shape{c.hidden, c.experts}, 53), 0.8f);
  const std::vector<std::vector<std::int64_t>> positions{{0, 1, 6, 7}, {2, 3, 4, 5}};
  nn::ParameterStore whole_store, whole_experts;
  auto whole_log = std::make_shared<ch07::MoeLog>();
  Tensor whole_y, whole_dx, whole_grad;
  on_ranks(1, [&](Communicator& comm) {
    ch07::MoeLayer layer(whole_store, comm, c, router, grouped_options(whole_log, &whole_experts));
    whole_store.allocate();
    whole_experts.allocate();
    nn::Forward f = layer.forward(x);
    whole_y = f.out.clone();
    whole_dx = layer.backward(w, f.saved).clone();
    whole_grad = layer.router().grad.clone();
  });
  std::vector<Tensor> grads(2);
  std::vector<ch07::RoutingStats> stats(2);
  on_ranks(2, [&](Communicator& ring) {
    auto self = ring.split(ring.rank(), 0);  // one expert-parallel rank: all experts here
    const auto me = static_cast<std::size_t>(ring.rank());
    auto rows = [&](const Tensor& all) {
      Tensor out(Shape{kGroups * 4, all.cols()}, DType::f32);
      for (int g = 0; g < kGroups; ++g)
        for (int i = 0; i < 4; ++i)
          out.slice(g * 4 + i, 1)
              .copy_from(
                  all.slice(g * kGroupTokens + positions[me][static_cast<std::size_t>(i)], 1));
      return out;
    };
    nn::ParameterStore store, experts;
    auto log = std::make_shared<ch07::MoeLog>();
    ch07::MoeOptions o = grouped_options(log, &experts);
    o.groups.split = &ring;
    o.groups.positions = positions;
    ch07::MoeLayer layer(store, *self, c, router, o);
    store.allocate();
    experts.allocate();
    nn::Forward f = layer.forward(rows(x));
    check_equal(f.out, rows(whole_y), "y of this rank's tokens, against the whole groups'");
    check_close(layer.backward(rows(w), f.saved), rows(whole_dx), 1e-6f, 1e-6f,
                "dL/dx of this rank's tokens");
    grads[me] = layer.router().grad.clone();
    stats[me] = log->stats;
  });
  check_close(add(grads[0], grads[1]), whole_grad, 1e-5f, 1e-5f,
              "dL/dWr summed over the two ranks, against the whole groups'");
  CHECK_MESSAGE(stats[0].dropped == whole_log->stats.dropped,
                "the first rank reports the groups' drops: " << stats[0].dropped << ", whole "
                                                             << whole_log->stats.dropped);
  CHECK(stats[1].dropped == 0);  // each group once: by its first rank
  CHECK(std::abs(stats[0].aux_loss - whole_log->stats.aux_loss) < 1e-9);
}

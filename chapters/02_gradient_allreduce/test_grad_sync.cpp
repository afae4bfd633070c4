// Chapter 02 tests: compiled against the solution (must pass) and the exercise stubs
// (every case must fail). World sizes 1, 2, 3, 4, 8; batches that do not split evenly.
#include <doctest/doctest.h>

#include <numeric>

#include "grad_sync.hpp"
#include "shardlab/testing.hpp"
#include "trainer.hpp"

using namespace shardlab;
using shardlab::testing::check_close;
using shardlab::testing::check_equal;
using shardlab::testing::for_each_world_size;

namespace {

/// Rank r's fake gradients: three tensors of odd sizes with rank-dependent values.
std::vector<Tensor> fake_grads(int rank) {
  std::vector<Tensor> g = {randn(3, 5, 100 + rank), randn(1, 7, 200 + rank),
                           randn(11, 2, 300 + rank)};
  return g;
}
std::vector<Tensor*> pointers(std::vector<Tensor>& v) {
  std::vector<Tensor*> p;
  for (Tensor& t : v) p.push_back(&t);
  return p;
}
/// sum_r (B_r / B) * g_r, in rank order.
std::vector<Tensor> weighted_average(int n, std::int64_t batch) {
  std::vector<Tensor> sum = fake_grads(0);
  for (Tensor& t : sum) std::fill(t.begin(), t.end(), 0.0f);
  for (int r = 0; r < n; ++r) {
    const auto share = static_cast<float>(static_cast<double>(shard_range(batch, n, r).length) /
                                          static_cast<double>(batch));
    std::vector<Tensor> g = fake_grads(r);
    for (std::size_t i = 0; i < g.size(); ++i) axpy(share, g[i], sum[i]);
  }
  return sum;
}

ch02::Config small_config(ch02::Sync sync) {
  ch02::Config cfg;
  cfg.in = 5;
  cfg.hidden = 9;
  cfg.batch = 13;  // no world size above 1 divides it
  cfg.steps = 6;
  cfg.sync = sync;
  cfg.bucket_kb = 0.1;  // 25 floats: several buckets
  return cfg;
}

/// max |a - b| / max |b|, both over all parameters of the two models.
double relative_distance(ch02::Mlp& a, ch02::Mlp& b) {
  double diff = 0, scale = 0;
  auto pa = a.parameters(), pb = b.parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    diff = std::max(diff, static_cast<double>(max_abs_diff(pa[i]->value, pb[i]->value)));
    scale = std::max(scale, static_cast<double>(max_abs(pb[i]->value)));
  }
  return diff / scale;
}

}  // namespace

TEST_SUITE("ch02") {
  TEST_CASE("allreduce_gradients leaves every rank with the batch-weighted average") {
    for_each_world_size([](int n) {
      const std::int64_t batch = 13;
      const std::vector<Tensor> want = weighted_average(n, batch);
      run_threads(n, [&](Communicator& comm) {
        std::vector<Tensor> g = fake_grads(comm.rank());
        const auto ptrs = pointers(g);
        ch02::allreduce_gradients(comm, ptrs, shard_range(batch, n, comm.rank()).length, batch);
        for (std::size_t i = 0; i < g.size(); ++i)
          check_close(g[i], want[i], 1e-6f, 1e-6f,
                      "gradient " + std::to_string(i) + " on rank " + std::to_string(comm.rank()));
      });
    });
  }

  TEST_CASE("plan_buckets keeps the order, respects the capacity and never splits a gradient") {
    std::vector<Tensor> g = fake_grads(0);  // 15, 7 and 22 elements
    const auto ptrs = pointers(g);
    for (std::int64_t bytes : {4, 40, 60, 88, 100, 176, 1 << 20}) {
      CAPTURE(bytes);
      const std::vector<ch02::Bucket> buckets = ch02::plan_buckets(ptrs, bytes);
      std::vector<std::size_t> order;
      for (const ch02::Bucket& b : buckets) {
        std::int64_t elements = 0;
        for (std::size_t i : b.tensors) elements += g[i].size();
        CHECK(b.elements == elements);
        // Over capacity only when a single gradient is bigger than a bucket.
        CHECK((b.elements * 4 <= std::max<std::int64_t>(bytes, 4) || b.tensors.size() == 1));
        order.insert(order.end(), b.tensors.begin(), b.tensors.end());
      }
      CHECK(order == std::vector<std::size_t>{0, 1, 2});
    }
    CHECK(ch02::plan_buckets(ptrs, 1 << 20).size() == 1);
    CHECK(ch02::plan_buckets(ptrs, 4).size() == 3);
    CHECK(ch02::plan_buckets(ptrs, 88).size() == 2);  // {15, 7} then {22}
  }

  TEST_CASE("pack lays a bucket's gradients back to back; unpack puts them back") {
    std::vector<Tensor> g = fake_grads(1);
    const auto ptrs = pointers(g);
    const ch02::Bucket bucket{{0, 2}, g[0].size() + g[2].size()};
    Tensor flat(bucket.elements);
    ch02::pack_bucket(bucket, ptrs, flat);
    CHECK(flat[0] == g[0][0]);
    CHECK(flat[g[0].size()] == g[2][0]);
    CHECK(flat[bucket.elements - 1] == g[2][g[2].size() - 1]);
    std::vector<Tensor> back = fake_grads(7);
    const auto back_ptrs = pointers(back);
    ch02::unpack_bucket(bucket, flat, back_ptrs);
    check_equal(back[0], g[0], "unpacked gradient 0");
    check_equal(back[2], g[2], "unpacked gradient 2");
    check_equal(back[1], fake_grads(7)[1], "gradient 1 is not in the bucket and stays");
  }

  TEST_CASE("bucketed averaging equals per-tensor averaging, for every bucket size") {
    for_each_world_size([](int n) {
      const std::int64_t batch = 13;
      const std::vector<Tensor> want = weighted_average(n, batch);
      for (std::int64_t bytes : {4, 60, 100, 1 << 20}) {
        CAPTURE(bytes);
        run_threads(n, [&](Communicator& comm) {
          std::vector<Tensor> g = fake_grads(comm.rank());
          const auto ptrs = pointers(g);
          for (const ch02::Bucket& b : ch02::plan_buckets(ptrs, bytes))
            ch02::allreduce_bucket(comm, b, ptrs, shard_range(batch, n, comm.rank()).length, batch);
          for (std::size_t i = 0; i < g.size(); ++i)
            check_close(g[i], want[i], 1e-6f, 1e-6f, "bucketed gradient " + std::to_string(i));
        });
      }
    });
  }

  TEST_CASE("replicas stay bitwise identical and match single-device training, every sync mode") {
    for (ch02::Sync sync : {ch02::Sync::allreduce, ch02::Sync::bucketed, ch02::Sync::overlap}) {
      CAPTURE(ch02::sync_name(sync));
      const ch02::Config cfg = small_config(sync);
      ch02::Mlp single(cfg);
      ch02::train_single_device(cfg, single);
      for_each_world_size([&](int n) {
        std::vector<ch02::Mlp> models(static_cast<std::size_t>(n), ch02::Mlp(cfg));
        run_threads(n, [&](Communicator& comm) {
          ch02::train(comm, cfg, models[static_cast<std::size_t>(comm.rank())]);
        });
        for (int r = 1; r < n; ++r) {
          auto a = models[0].parameters(), b = models[static_cast<std::size_t>(r)].parameters();
          for (std::size_t i = 0; i < a.size(); ++i)
            check_equal(b[i]->value, a[i]->value,
                        "parameter " + std::to_string(i) + " of rank " + std::to_string(r));
        }
        CHECK(relative_distance(models[0], single) <= 1e-6);
      });
    }
  }

  TEST_CASE("gradient accumulation over k micro-batches equals one step on the whole batch") {
    for (int k : {2, 3, 5}) {
      CAPTURE(k);
      ch02::Config cfg = small_config(ch02::Sync::bucketed);
      cfg.accum_steps = k;
      ch02::Mlp single(cfg);
      ch02::train_single_device(cfg, single);
      for (int n : {1, 2, 3}) {
        CAPTURE(n);
        std::vector<ch02::Mlp> models(static_cast<std::size_t>(n), ch02::Mlp(cfg));
        std::vector<std::uint64_t> calls(static_cast<std::size_t>(n));
        run_threads(n, [&](Communicator& comm) {
          const ch02::Trace t =
              ch02::train(comm, cfg, models[static_cast<std::size_t>(comm.rank())]);
          calls[static_cast<std::size_t>(comm.rank())] = t.allreduce.calls;
        });
        CHECK(relative_distance(models[0], single) <= 1e-6);
        // One sync per step, not per micro-batch.
        std::vector<Tensor> g;
        for (auto* p : models[0].parameters()) g.push_back(p->grad);
        CHECK(calls[0] ==
              ch02::plan_buckets(pointers(g), static_cast<std::int64_t>(cfg.bucket_kb * 1024))
                      .size() *
                  static_cast<std::size_t>(cfg.steps));
      }
    }
  }
}

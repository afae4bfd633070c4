// Chapter 02 tests: compiled against the solution (must pass) and the exercise stubs
// (every case must fail). World sizes 1, 2, 3, 4, 8; batches that do not split evenly.
//
// Wrong versions these tests were checked against: no scaling (a sum, not an average);
// dividing by P instead of weighting by B_r / B (uneven batches); buckets planned first to
// last (order); a bucket's offset taken as its first parameter's (the range then covers
// the wrong gradients); a bucket allreduced without scaling; allreduce_gradients calling
// comm.allreduce instead of the plugged-in allreduce. GradSync itself, on other models:
// test_gradient_sync.cpp.
#include <doctest/doctest.h>

#include <memory>
#include <numeric>

#include "grad_sync.hpp"
#include "shardlab/testing.hpp"
#include "trainer.hpp"

using namespace shardlab;
using shardlab::testing::check_close;
using shardlab::testing::check_equal;
using shardlab::testing::for_each_world_size;
using shardlab::testing::on_ranks;

namespace {

/// Rank r's fake gradients: three parameters of odd sizes (15, 7 and 22 elements) in one
/// store, with rank-dependent values in their gradients.
struct FakeModel {
  nn::ParameterStore store;
  std::vector<nn::Parameter*> params;
  explicit FakeModel(int rank) {
    store.add("a", zeros(3, 5));
    store.add("b", zeros(1, 7));
    store.add("c", zeros(11, 2));
    store.allocate();
    params = store.parameters();
    for (std::size_t i = 0; i < params.size(); ++i)
      params[i]->grad.copy_from(randn(params[i]->grad.rows(), params[i]->grad.cols(),
                                      100 * (i + 1) + static_cast<std::uint64_t>(rank)));
  }
};

/// sum_r (B_r / B) * g_r, in rank order, parameter by parameter.
std::vector<Tensor> weighted_average(int n, std::int64_t batch) {
  const FakeModel shapes(0);
  std::vector<Tensor> sum;
  for (nn::Parameter* p : shapes.params) sum.push_back(zeros(p->grad.rows(), p->grad.cols()));
  for (int r = 0; r < n; ++r) {
    const auto share = static_cast<float>(static_cast<double>(shard_range(batch, n, r).length) /
                                          static_cast<double>(batch));
    FakeModel g(r);
    for (std::size_t i = 0; i < sum.size(); ++i) axpy(share, g.params[i]->grad, sum[i]);
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

/// max |a - b| / max |b|, over all parameters of the two models.
double relative_distance(ch02::Model& a, ch02::Model& b) {
  return max_abs_diff(a.store.values(), b.store.values()) / max_abs(b.store.values());
}

/// n models, one per rank.
std::vector<std::unique_ptr<ch02::Model>> models_for(int n, const ch02::Config& cfg) {
  std::vector<std::unique_ptr<ch02::Model>> models;
  for (int r = 0; r < n; ++r) models.push_back(std::make_unique<ch02::Model>(cfg));
  return models;
}

}  // namespace

TEST_SUITE("ch02") {
  TEST_CASE("allreduce_gradients leaves every rank with the batch-weighted average") {
    for_each_world_size([](int n) {
      const std::int64_t batch = 13;
      const std::vector<Tensor> want = weighted_average(n, batch);
      on_ranks(n, [&](Communicator& comm) {
        FakeModel g(comm.rank());
        ch02::allreduce_gradients(comm, g.params, shard_range(batch, n, comm.rank()).length, batch);
        for (std::size_t i = 0; i < want.size(); ++i)
          check_close(g.params[i]->grad, want[i], 1e-6f, 1e-6f,
                      "gradient " + std::to_string(i) + " on rank " + std::to_string(comm.rank()));
      });
    });
  }

  TEST_CASE(
      "allreduce_gradients runs a plugged-in allreduce, once per tensor, not the native one") {
    for_each_world_size([](int n) {
      const std::int64_t batch = 13;
      const std::vector<Tensor> want = weighted_average(n, batch);
      on_ranks(n, [&](Communicator& comm) {
        FakeModel g(comm.rank());
        std::vector<std::int64_t> sizes;
        auto plugged = [&](Communicator& c, Tensor& t) {
          sizes.push_back(t.size());
          ch02::native_allreduce(c, t);
        };
        const shardlab::CommStats before = comm.stats();
        ch02::allreduce_gradients(comm, g.params, shard_range(batch, n, comm.rank()).length, batch,
                                  plugged);
        CHECK(sizes == std::vector<std::int64_t>{15, 7, 22});
        // Three allreduces, the plug's own (it calls the native one): none besides.
        CHECK(comm.stats().since(before)[Op::allreduce].calls == 3);
        for (std::size_t i = 0; i < want.size(); ++i)
          check_close(g.params[i]->grad, want[i], 1e-6f, 1e-6f,
                      "gradient " + std::to_string(i) + " on rank " + std::to_string(comm.rank()));
      });
    });
  }

  TEST_CASE("plan_buckets walks last to first, respects the capacity, never splits a gradient") {
    FakeModel g(0);  // 15, 7 and 22 elements at offsets 0, 15, 22
    for (std::int64_t bytes : {4, 40, 60, 88, 100, 116, 176, 1 << 20}) {
      CAPTURE(bytes);
      const std::vector<ch02::Bucket> buckets = ch02::plan_buckets(g.params, bytes);
      std::vector<std::size_t> order;
      for (const ch02::Bucket& b : buckets) {
        std::int64_t elements = 0, first = g.store.size();
        for (std::size_t i : b.params) {
          elements += g.params[i]->grad.size();
          first = std::min(first, g.params[i]->offset);
        }
        CHECK(b.elements == elements);
        CHECK_MESSAGE(b.offset == first, "bucket offset " << b.offset << ", but its first element "
                                                          << "is at " << first);
        // Over capacity only when a single gradient is bigger than a bucket.
        CHECK((b.elements * 4 <= std::max<std::int64_t>(bytes, 4) || b.params.size() == 1));
        order.insert(order.end(), b.params.begin(), b.params.end());
      }
      CHECK(order == std::vector<std::size_t>{2, 1, 0});
    }
    CHECK(ch02::plan_buckets(g.params, 1 << 20).size() == 1);
    CHECK(ch02::plan_buckets(g.params, 4).size() == 3);
    const std::vector<ch02::Bucket> two = ch02::plan_buckets(g.params, 116);  // {22, 7} then {15}
    REQUIRE(two.size() == 2);
    CHECK(two[0].offset == 15);
    CHECK(two[0].elements == 29);
    CHECK(two[1].offset == 0);
  }

  TEST_CASE("a bucket's allreduce averages its range of the flat buffer, in place, and only it") {
    for_each_world_size([](int n) {
      const std::int64_t batch = 13;
      const std::vector<Tensor> want = weighted_average(n, batch);
      on_ranks(n, [&](Communicator& comm) {
        FakeModel g(comm.rank());
        const FakeModel untouched(comm.rank());
        const std::vector<ch02::Bucket> buckets = ch02::plan_buckets(g.params, 116);
        Request r = ch02::start_bucket_allreduce(comm, g.store.grads(), buckets[0],
                                                 shard_range(batch, n, comm.rank()).length, batch);
        comm.wait(r);
        // Bucket 0 holds parameters 2 and 1; parameter 0 must not change.
        check_close(g.params[2]->grad, want[2], 1e-6f, 1e-6f, "parameter 2 (in the bucket)");
        check_close(g.params[1]->grad, want[1], 1e-6f, 1e-6f, "parameter 1 (in the bucket)");
        check_equal(g.params[0]->grad, untouched.params[0]->grad, "parameter 0 (not in it)");
      });
    });
  }

  TEST_CASE("bucketed averaging equals per-tensor averaging, for every bucket size") {
    for_each_world_size([](int n) {
      const std::int64_t batch = 13;
      const std::vector<Tensor> want = weighted_average(n, batch);
      for (std::int64_t bytes : {4, 60, 100, 1 << 20}) {
        CAPTURE(bytes);
        on_ranks(n, [&](Communicator& comm) {
          FakeModel g(comm.rank());
          std::vector<Request> pending;
          for (const ch02::Bucket& b : ch02::plan_buckets(g.params, bytes))
            pending.push_back(ch02::start_bucket_allreduce(
                comm, g.store.grads(), b, shard_range(batch, n, comm.rank()).length, batch));
          comm.wait_all(pending);
          for (std::size_t i = 0; i < want.size(); ++i)
            check_close(g.params[i]->grad, want[i], 1e-6f, 1e-6f,
                        "bucketed gradient " + std::to_string(i));
        });
      }
    });
  }

  TEST_CASE("replicas stay bitwise identical and match single-device training, every sync mode") {
    for (ch02::Sync sync : {ch02::Sync::allreduce, ch02::Sync::bucketed, ch02::Sync::overlap}) {
      CAPTURE(ch02::sync_name(sync));
      const ch02::Config cfg = small_config(sync);
      ch02::Model single(cfg);
      ch02::train_single_device(cfg, single);
      for_each_world_size([&](int n) {
        auto models = models_for(n, cfg);
        on_ranks(n, [&](Communicator& comm) {
          ch02::train(comm, cfg, *models[static_cast<std::size_t>(comm.rank())]);
        });
        for (int r = 1; r < n; ++r)
          check_equal(models[static_cast<std::size_t>(r)]->store.values(),
                      models[0]->store.values(), "parameters of rank " + std::to_string(r));
        CHECK(relative_distance(*models[0], single) <= 1e-6);
      });
    }
  }

  TEST_CASE("gradient accumulation over k micro-batches equals one step on the whole batch") {
    for (int k : {2, 3, 5}) {
      CAPTURE(k);
      ch02::Config cfg = small_config(ch02::Sync::bucketed);
      cfg.accum_steps = k;
      ch02::Model single(cfg);
      ch02::train_single_device(cfg, single);
      for (int n : {1, 2, 3}) {
        CAPTURE(n);
        auto models = models_for(n, cfg);
        std::vector<std::uint64_t> calls(static_cast<std::size_t>(n));
        on_ranks(n, [&](Communicator& comm) {
          const ch02::Trace t =
              ch02::train(comm, cfg, *models[static_cast<std::size_t>(comm.rank())]);
          calls[static_cast<std::size_t>(comm.rank())] = t.allreduce.calls;
        });
        CHECK(relative_distance(*models[0], single) <= 1e-6);
        // One sync per step, not per micro-batch.
        CHECK(calls[0] == ch02::plan_buckets(models[0]->store.parameters(),
                                             static_cast<std::int64_t>(cfg.bucket_kb * 1024))
                                  .size() *
                              static_cast<std::size_t>(cfg.steps));
      }
    }
  }
}

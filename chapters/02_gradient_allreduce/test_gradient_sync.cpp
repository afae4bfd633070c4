// GradSync (grad_sync.hpp) tests, mostly on a model that is not chapter 02's MLP:
// tokens -> Embedding(V, C) -> LayerNorm(C) -> Linear(C, K) -> softmax cross-entropy, the
// batch split unevenly over 1, 2, 3, 4 and 8 ranks (and over more ranks than rows); and
// the overlap on the chapter's MLP. Compiled against the solution (must pass) and the
// exercise stubs (every case must fail: GradSync runs the stubs).
//
// Names: B rows in the global batch, B_r on rank r, P ranks, V = 11 tokens, C = 6
// channels, K = 5 classes, G = the gradient bytes, u = 2^-24.
//
// What is compared, over every element of the flat gradient buffer:
//   - replicas with each other: bitwise (every rank receives the same allreduced bits);
//   - every mode (per tensor, bucketed, overlapped, a plugged-in allreduce) with the
//     per-tensor one: bitwise (the threads backend adds every element's contributions in
//     rank order, whatever range it allreduces; the plug here adds in rank order too);
//   - against the single-device gradient of the full batch: each element is a sum over
//     the B rows, in another order (per rank, then over the ranks). A float sum of n
//     terms in any order is within n u of the sum of their magnitudes (Higham, Accuracy
//     and Stability of Numerical Algorithms, §4.2). The terms differ in their last bits
//     too (a rank's rows are scaled by 1/B_r, then B_r/B, instead of 1/B), which the
//     LayerNorm's backward amplifies by its cancellation (rows of mean zero). So the
//     bound is taken per parameter tensor p, from its largest sum of magnitudes:
//         |g - g_single| <= 4 (B + P) u max_p S   for every element of p,
//     S = an element's sum over the rows of |that row's term| (measured one row at a
//     time). Measured: at most 0.54 (B + P) u max_p S, over every world size and mode.
//
// Wrong versions these tests were checked against, and what each failed with:
//   - finish() syncs while disabled: "micro-batch 0 communicated under NoSync";
//   - ready() starts buckets while disabled: the same;
//   - overlap starts a bucket once any of its gradients is ready, not all: bucket 0 =
//     [head.bias head.weight norm.beta] goes before the norm's backward, "step 1 ..., vs
//     the single device" in overlap mode (and the MLP's trainer test);
//   - finish() leaves the ready marks set: "step 2 ..., vs the single device" (step 2
//     starts every bucket at the first ready());
//   - set_batch ignored, every rank weighted 1/P: "vs the single device" (uneven shards);
//   - bucketed mode skips the last bucket (the embedding): "vs the single device";
//   - overlap's finish() does not start the buckets nobody announced: "finish alone";
//   - a plug ignored for buckets, or by allreduce_gradients: "the plugged allreduce ran
//     0 times", "the native allreduce ran ... beside the plugged one";
//   - ch02::backward announcing a layer before its weight gradients are added: "vs the
//     single device" in overlap mode;
//   - NoSync switching the sync on when it ends: "NoSync switched on a sync it had found
//     off";
//   - each bucket allreducing the whole flat buffer: "rank r sent ... the chunks' formula
//     says ...", "all ranks sent ..., not 2 x 2(N-1) x G".
#include <doctest/doctest.h>

#include <cmath>
#include <memory>

#include "grad_sync.hpp"
#include "shardlab/format.hpp"
#include "shardlab/testing.hpp"
#include "trainer.hpp"

using namespace shardlab;
using ch02::Sync;
using shardlab::testing::check_equal;
using shardlab::testing::for_each_world_size;
using shardlab::testing::on_ranks;

namespace {

constexpr std::int64_t V = 11, C = 6, K = 5;
constexpr double u = 0x1p-24;

/// A layer that does nothing but call `probe` when backward passes through it.
class Probe final : public nn::Layer {
 public:
  explicit Probe(std::function<void()> probe) : probe_(std::move(probe)) {}
  std::string name() const override { return "probe"; }
  nn::Forward forward(const Tensor& x) const override { return {x, {}}; }
  Tensor backward_input(const Tensor& dy, nn::Saved&) const override {
    probe_();
    return dy;
  }

 private:
  std::function<void()> probe_;
};

/// Parameters: embed.weight (66), norm.gamma (6), norm.beta (6), head.weight (30),
/// head.bias (5); 113 floats. A probe, if given, sits between the norm and the head.
struct TokenModel {
  nn::ParameterStore store;
  nn::Sequential layers;
  explicit TokenModel(std::shared_ptr<nn::Layer> probe = nullptr, std::uint64_t seed = 7) {
    layers.add<nn::Embedding>(store, "embed", V, C, seed, 0.7f);
    layers.add<nn::LayerNorm>(store, "norm", C);
    if (probe) layers.add(std::move(probe));
    layers.add<nn::Linear>(store, "head", C, K, seed + 1);
    store.allocate();
    // LayerNorm starts at gamma = 1, beta = 0; move them off it so that their gradients
    // depend on everything upstream.
    for (nn::Parameter* p : store.parameters())
      if (p->name.rfind("norm", 0) == 0)
        for (std::int64_t i = 0; i < p->value.size(); ++i)
          p->value.data()[i] += 0.1f * static_cast<float>((i * 5 + 1) % 7) - 0.3f;
  }
};

/// Rows [begin, begin + count) of data set `set`: token ids and target classes.
Tensor tokens(std::int64_t begin, std::int64_t count, int set = 0) {
  std::vector<std::int64_t> ids;
  for (std::int64_t i = begin; i < begin + count; ++i) ids.push_back((7 * i + 3 + set) % V);
  return Tensor::from_vector(ids);
}
Tensor targets(std::int64_t begin, std::int64_t count, int set = 0) {
  std::vector<std::int64_t> ids;
  for (std::int64_t i = begin; i < begin + count; ++i) ids.push_back((3 * i + i / 5 + set) % K);
  return Tensor::from_vector(ids);
}

/// Adds `weight` times the gradient of the mean loss over rows [begin, begin + count)
/// into the model's gradients, through ch02::backward (which tells `sync` per layer).
void backward_rows(TokenModel& m, std::int64_t begin, std::int64_t count, double weight,
                   ch02::GradSync& sync, int set = 0) {
  if (count == 0) return;  // no rows: nothing to add (the sync still takes part)
  nn::Forward f = m.layers.forward(tokens(begin, count, set));
  nn::Loss loss = nn::cross_entropy(f.out, targets(begin, count, set));
  Tensor dy = nn::cross_entropy_backward(loss.saved);
  if (weight != 1.0) dy = scale(dy, static_cast<float>(weight));
  ch02::backward(m.layers, dy, f.saved, sync, /*input_gradient=*/false);
}

/// The reference, on one device with nn's own backward (no GradSync): the gradient of
/// the mean loss over all B rows, and for each element max_p S over its tensor p (top).
struct Reference {
  Tensor grads, magnitude;
};
Reference single_device(std::int64_t batch, int set = 0) {
  TokenModel m;
  auto grad_of = [&](std::int64_t begin, std::int64_t count) {
    m.store.zero_grad();
    nn::Forward f = m.layers.forward(tokens(begin, count, set));
    nn::Loss loss = nn::cross_entropy(f.out, targets(begin, count, set));
    m.layers.backward(nn::cross_entropy_backward(loss.saved), f.saved);
    return m.store.grads().clone();
  };
  Reference ref{grad_of(0, batch), Tensor(m.store.size())};
  Tensor S(m.store.size());
  for (std::int64_t i = 0; i < batch; ++i) {
    const Tensor row = grad_of(i, 1);  // row i's term, times B
    for (std::int64_t e = 0; e < row.size(); ++e)
      S[e] += std::fabs(row[e]) / static_cast<float>(batch);
  }
  for (const nn::Parameter* p : m.store.parameters()) {
    const std::int64_t begin = p->offset, end = p->offset + p->grad.size();
    float largest = 0;
    for (std::int64_t e = begin; e < end; ++e) largest = std::max(largest, S[e]);
    for (std::int64_t e = begin; e < end; ++e) ref.magnitude[e] = largest;
  }
  return ref;
}

/// "" when |got - want| <= 4 (B + P) u max_p S everywhere, else the worst element.
std::string against_single_device(const Tensor& got, const Reference& ref, std::int64_t batch,
                                  int ranks) {
  const double factor = 4.0 * static_cast<double>(batch + ranks) * u;
  std::int64_t worst = -1;
  double excess = 0;
  for (std::int64_t e = 0; e < got.size(); ++e) {
    const double diff = std::fabs(static_cast<double>(got[e]) - ref.grads[e]);
    const double bound = factor * ref.magnitude[e];
    if (!(diff <= bound) && (worst < 0 || diff - bound > excess)) {
      worst = e;
      excess = diff - bound;
    }
  }
  if (worst < 0) return "";
  return "element " + std::to_string(worst) + ": " + format_number(got[worst], 9) +
         ", single device " + format_number(ref.grads[worst], 9) + ", bound " +
         format_number(factor * ref.magnitude[worst], 3) +
         " (S = " + format_number(ref.magnitude[worst], 3) + ")";
}

/// A plugged-in allreduce from point-to-point calls: every rank's buffer to rank 0,
/// added there in rank order, the sum sent back. It counts its calls.
struct RankOrderAllreduce {
  int calls = 0;
  void operator()(Communicator& comm, Tensor& t) {
    ++calls;
    if (comm.rank() != 0) {
      comm.send(t, 0);
      comm.recv(t, 0);
      return;
    }
    Tensor part(t.shape(), DType::f32);
    for (int q = 1; q < comm.size(); ++q) {
      comm.recv(part, q);
      for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] += part.data()[i];
    }
    for (int q = 1; q < comm.size(); ++q) comm.send(t, q);
  }
};

/// Bytes rank r sends in the threads backend's allreduce of S floats over N ranks:
/// S + (N-2) |c_r| elements, c_r = the r-th of N near-equal chunks.
std::uint64_t allreduce_bytes(std::int64_t S, int N, int r) {
  const std::int64_t chunk = S / N + (r < S % N ? 1 : 0);
  return static_cast<std::uint64_t>(4 * (S + (N - 2) * chunk));
}

struct Mode {
  Sync sync;
  std::int64_t bucket_bytes;
  bool plugged;
};
// Bucket plans, gradients walked last to first (head.bias 5, head.weight 30, norm.beta 6,
// norm.gamma 6, embed.weight 66): 4 bytes, one tensor each; 176 (44 floats):
// [head.bias head.weight norm.beta] [norm.gamma] [embed.weight], bucket 0 spanning two
// layers; 1 MiB: one bucket.
const Mode modes[] = {{Sync::allreduce, 0, false},     {Sync::bucketed, 4, false},
                      {Sync::bucketed, 176, false},    {Sync::bucketed, 1 << 20, false},
                      {Sync::overlap, 4, false},       {Sync::overlap, 176, false},
                      {Sync::overlap, 1 << 20, false}, {Sync::allreduce, 0, true},
                      {Sync::bucketed, 176, true},     {Sync::overlap, 176, true}};

/// The GradSync configuration of `mode`; a plugged one calls `plug`.
ch02::GradSyncConfig config_of(const Mode& mode, RankOrderAllreduce& plug) {
  ch02::GradSyncConfig config{.mode = mode.sync, .bucket_bytes = mode.bucket_bytes};
  if (mode.plugged) config.allreduce = [&plug](Communicator& c, Tensor& t) { plug(c, t); };
  return config;
}

std::string describe(const Mode& m) {
  return std::string(ch02::sync_name(m.sync)) + " " + std::to_string(m.bucket_bytes) + " bytes" +
         (m.plugged ? ", plugged" : "");
}

}  // namespace

TEST_SUITE("ch02") {
  TEST_CASE("GradSync on Embedding + LayerNorm + Linear: one device's full-batch gradient") {
    for (std::int64_t batch : {13, 3}) {
      CAPTURE(batch);
      const Reference ref = single_device(batch);
      for_each_world_size([&](int n) {
        std::vector<Tensor> per_tensor(static_cast<std::size_t>(n));
        for (const Mode& mode : modes) {
          const std::string what = describe(mode);
          CAPTURE(what);
          std::vector<Tensor> got(static_cast<std::size_t>(n));
          on_ranks(n, [&](Communicator& comm) {
            const auto r = static_cast<std::size_t>(comm.rank());
            const ShardRange rows = shard_range(batch, n, comm.rank());
            TokenModel m;
            RankOrderAllreduce plug;
            ch02::GradSync sync(comm, m.store, config_of(mode, plug));
            sync.set_batch(rows.length, batch);
            const shardlab::CommStats start = comm.stats();
            // Two steps on one GradSync: what the first leaves behind must not leak.
            for (int step = 0; step < 2; ++step) {
              m.store.zero_grad();
              backward_rows(m, rows.offset, rows.length, 1.0, sync);
              sync.finish();
              const std::string off = against_single_device(m.store.grads(), ref, batch, n);
              CHECK_MESSAGE(off.empty(), "step " << step + 1 << " on rank " << r
                                                 << ", vs the single device: " << off);
            }
            got[r] = m.store.grads().clone();
            // The traffic of the two steps, per rank: 2(N-1)/N x G when N divides every
            // bucket; exactly the chunks' formula always (summed over ranks below).
            const shardlab::CommStats moved = comm.stats().since(start);
            const std::size_t messages =
                mode.sync == Sync::allreduce ? m.store.parameters().size() : sync.buckets().size();
            if (mode.plugged) {
              CHECK_MESSAGE(plug.calls == static_cast<int>(2 * messages),
                            "the plugged allreduce ran " << plug.calls << " times in 2 steps, not "
                                                         << 2 * messages << " (one per "
                                                         << "tensor or bucket)");
              CHECK_MESSAGE(moved[Op::allreduce].calls == 0,
                            "the native allreduce ran " << moved[Op::allreduce].calls
                                                        << " times beside the plugged one");
            } else {
              std::uint64_t want = 0;
              if (mode.sync == Sync::allreduce)
                for (nn::Parameter* p : m.store.parameters())
                  want += allreduce_bytes(p->grad.size(), n, comm.rank());
              else
                for (const ch02::Bucket& b : sync.buckets())
                  want += allreduce_bytes(b.elements, n, comm.rank());
              CHECK_MESSAGE(
                  moved[Op::allreduce].calls == 2 * messages,
                  moved[Op::allreduce].calls << " allreduces in 2 steps, not " << 2 * messages);
              CHECK_MESSAGE(moved[Op::allreduce].bytes_sent == 2 * want,
                            "rank " << r << " sent " << moved[Op::allreduce].bytes_sent
                                    << " bytes in 2 steps; the chunks' formula says " << 2 * want);
              const std::int64_t total = comm.agree(
                  static_cast<std::int64_t>(moved[Op::allreduce].bytes_sent), ReduceOp::sum);
              const std::int64_t G = 4 * m.store.size();
              CHECK_MESSAGE(total == 2 * 2 * (n - 1) * G,
                            "all ranks sent " << total << " bytes in 2 steps, not 2 x 2(N-1) x G = "
                                              << 4 * (n - 1) * G);
            }
          });
          for (int r = 1; r < n; ++r)
            check_equal(got[static_cast<std::size_t>(r)], got[0],
                        "rank " + std::to_string(r) + "'s gradients against rank 0's");
          if (mode.sync == Sync::allreduce && !mode.plugged)
            per_tensor = got;
          else if (per_tensor[0].defined())
            check_equal(got[0], per_tensor[0], "against the per-tensor mode's bits");
        }
      });
    }
  }

  TEST_CASE("no-sync accumulation over k micro-batches, then one sync, is one big batch") {
    const std::int64_t batch = 13;
    const Reference ref = single_device(batch);
    for (int k : {2, 3, 5}) {
      CAPTURE(k);
      for (const Mode& mode : modes) {
        const std::string what = describe(mode);
        CAPTURE(what);
        for (int n : {1, 2, 3, 4}) {
          CAPTURE(n);
          on_ranks(n, [&](Communicator& comm) {
            const ShardRange rows = shard_range(batch, n, comm.rank());
            TokenModel m;
            RankOrderAllreduce plug;
            ch02::GradSync sync(comm, m.store, config_of(mode, plug));
            sync.set_batch(rows.length, batch);
            m.store.zero_grad();
            const shardlab::CommStats start = comm.stats();
            for (int mb = 0; mb < k; ++mb) {
              // Micro-batch mb of my rows, weighted by its share of them.
              const ShardRange part = shard_range(rows.length, k, mb);
              const double weight =
                  rows.length ? static_cast<double>(part.length) / static_cast<double>(rows.length)
                              : 0.0;
              if (mb + 1 < k) {
                ch02::NoSync accumulate(sync);
                backward_rows(m, rows.offset + part.offset, part.length, weight, sync);
                sync.finish();  // off: must not communicate
              } else {
                backward_rows(m, rows.offset + part.offset, part.length, weight, sync);
              }
              if (mb + 1 < k) {
                const shardlab::CommStats so_far = comm.stats().since(start);
                CHECK_MESSAGE((so_far.total().calls == 0 && plug.calls == 0),
                              "micro-batch " << mb << " communicated under NoSync");
              }
            }
            CHECK(sync.enabled());
            sync.finish();
            const std::string off = against_single_device(m.store.grads(), ref, batch, n);
            CHECK_MESSAGE(off.empty(), "no-sync accumulation on rank "
                                           << comm.rank() << ", vs the single device: " << off);
            Tensor mine = m.store.grads().clone();
            CHECK(replica_divergence(comm, mine) == 0.0);
          });
        }
      }
    }
  }

  TEST_CASE("overlap starts a bucket while backward still runs, bucketed waits for finish()") {
    for (int n : {2, 3}) {
      CAPTURE(n);
      // 176 bytes: bucket 0 = [head.bias head.weight norm.beta] is ready after the norm's
      // backward, which runs after the probe; 4 bytes: [head.bias] is ready before it.
      for (const Mode& mode : {Mode{Sync::overlap, 4, false}, Mode{Sync::overlap, 176, false},
                               Mode{Sync::bucketed, 4, false}}) {
        const std::string what = describe(mode);
        CAPTURE(what);
        on_ranks(n, [&](Communicator& comm) {
          ch02::GradSync* current = nullptr;
          std::size_t started_at_probe = 0;
          std::uint64_t calls_at_probe = 0;
          const shardlab::CommStats start = comm.stats();
          TokenModel m(std::make_shared<Probe>([&] {
            started_at_probe = current->started();
            calls_at_probe = comm.stats().since(start)[Op::allreduce].calls;
          }));
          ch02::GradSync sync(comm, m.store,
                              {.mode = mode.sync, .bucket_bytes = mode.bucket_bytes});
          current = &sync;
          m.store.zero_grad();
          backward_rows(m, 0, 4, 1.0, sync);
          const bool early = mode.sync == Sync::overlap && mode.bucket_bytes == 4;
          // [head.bias] and [head.weight]: both started before the norm's backward.
          CHECK(started_at_probe == (early ? 2u : 0u));
          CHECK(calls_at_probe == (early ? 2u : 0u));
          sync.finish();
          CHECK(comm.stats().since(start)[Op::allreduce].calls == sync.buckets().size());
        });
      }
    }
  }

  TEST_CASE("overlap starts layer 2's bucket while layer 1's backward is still to run") {
    // The chapter's MLP with a probe between its layers: what has started when backward
    // reaches layer 1? Buckets, last to first, of 40 bytes: [b2 W2] [b1] [W1] (layer 2's
    // bucket is ready first); of 76 bytes: [b2 W2 b1] [W1] (it waits for b1, layer 1's).
    ch02::Config cfg;
    cfg.in = 5;
    cfg.hidden = 9;
    struct Case {
      ch02::Sync sync;
      std::int64_t bucket_bytes;
      std::size_t started_before_layer1;
    };
    for (const Case c : {Case{ch02::Sync::overlap, 40, 1}, Case{ch02::Sync::overlap, 76, 0},
                         Case{ch02::Sync::bucketed, 40, 0}}) {
      CAPTURE(c.bucket_bytes);
      on_ranks(3, [&](Communicator& comm) {
        ch02::Model model(cfg);
        ch02::GradSync sync(comm, model.store, {.mode = c.sync, .bucket_bytes = c.bucket_bytes});
        std::size_t started = 99;
        std::uint64_t calls = 99;
        const CommStats start = comm.stats();
        nn::Sequential probed;
        probed.add(std::make_shared<nn::Sequential>(model.layers.slice(0, 2)));  // W1, tanh
        probed.add(std::make_shared<Probe>([&] {
          started = sync.started();
          calls = comm.stats().since(start)[Op::allreduce].calls;
        }));
        probed.add(std::make_shared<nn::Sequential>(model.layers.slice(2, 3)));  // W2
        const toy::Batch b = toy::Teacher(cfg.model(), cfg.seed).batch(6, 0);
        nn::Forward f = probed.forward(b.x);
        model.store.zero_grad();
        ch02::backward(probed, nn::mse_backward(f.out, b.y, 6.0), f.saved, sync, false);
        CHECK_MESSAGE(started == c.started_before_layer1,
                      started << " bucket(s) started before layer 1's backward");
        CHECK(calls == c.started_before_layer1);  // started, not just planned
        sync.finish();
        CHECK(comm.stats().since(start)[Op::allreduce].calls == sync.buckets().size());
        CHECK(replica_divergence(comm, model.store.grads()) == 0.0);
      });
    }
  }

  TEST_CASE("overlap's finish() alone syncs every bucket, in order, when nobody called ready()") {
    const std::int64_t batch = 13;
    const Reference ref = single_device(batch);
    for (int n : {2, 3}) {
      CAPTURE(n);
      on_ranks(n, [&](Communicator& comm) {
        const ShardRange rows = shard_range(batch, n, comm.rank());
        TokenModel m;
        ch02::GradSync sync(comm, m.store, {.mode = Sync::overlap, .bucket_bytes = 176});
        sync.set_batch(rows.length, batch);
        // A trainer with its own backward: nn's, which tells nobody.
        m.store.zero_grad();
        nn::Forward f = m.layers.forward(tokens(rows.offset, rows.length));
        nn::Loss loss = nn::cross_entropy(f.out, targets(rows.offset, rows.length));
        m.layers.backward(nn::cross_entropy_backward(loss.saved), f.saved);
        CHECK(sync.started() == 0);  // nobody said a thing
        sync.finish();
        const std::string off = against_single_device(m.store.grads(), ref, batch, n);
        CHECK_MESSAGE(off.empty(), "finish alone, vs the single device: " << off);
        // NoSync gives back what it found.
        sync.set_enabled(false);
        { ch02::NoSync inner(sync); }
        CHECK_MESSAGE(!sync.enabled(), "NoSync switched on a sync it had found off");
      });
    }
  }

  TEST_CASE("GradSync on one axis of a 2 x 2 mesh averages over that axis only") {
    // 2 x 2 mesh (dp, tp): the two tp columns train on different data sets; each dp pair
    // must end with its own data set's full-batch gradient.
    const std::int64_t batch = 7;
    const Reference refs[] = {single_device(batch, 0), single_device(batch, 1)};
    for (Sync sync_mode : {Sync::allreduce, Sync::bucketed, Sync::overlap}) {
      CAPTURE(ch02::sync_name(sync_mode));
      on_ranks(4, [&](Communicator& world) {
        // World rank 2 d + t is at (dp d, tp t); its dp group is the ranks of its column.
        const int set = world.rank() % 2;
        const std::unique_ptr<Communicator> dp_group = world.split(set, world.rank() / 2);
        Communicator& dp = *dp_group;
        const ShardRange rows = shard_range(batch, dp.size(), dp.rank());
        TokenModel m;
        ch02::GradSync sync(dp, m.store, {.mode = sync_mode, .bucket_bytes = 176});
        sync.set_batch(rows.length, batch);
        m.store.zero_grad();
        backward_rows(m, rows.offset, rows.length, 1.0, sync, set);
        sync.finish();
        const std::string off = against_single_device(m.store.grads(), refs[set], batch, dp.size());
        CHECK_MESSAGE(off.empty(), "world rank " << world.rank() << " (data set " << set
                                                 << "), vs its single device: " << off);
      });
    }
  }
}

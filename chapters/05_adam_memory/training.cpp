// Chapter 05's training loop: one model, four ways of keeping its states.
#include "training.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"
#include "zero1.hpp"

using namespace shardlab;
using memory::Category;
using Scope = memory::Scope;

namespace ch05 {

std::string precision_name(Precision p) { return p == Precision::fp32 ? "fp32" : "mixed"; }

Shard make_shard(Communicator& comm, Tensor& params, DType grad_type) {
  Shard s;
  s.range = shard_range(params.size(), comm.size(), comm.rank());
  const Tensor mine = params.slice(s.range.offset, s.range.length);
  const Shape shape{s.range.length};
  if (params.dtype() == DType::f32) {
    s.master = mine;  // fp32 training: the optimizer updates the parameters themselves
  } else {
    Scope scope(Category::master);
    s.master = cast(mine, DType::f32);
  }
  {
    Scope scope(Category::optimizer);
    s.m = Tensor(shape, DType::f32, params.memory());
    s.v = Tensor(shape, DType::f32, params.memory());
  }
  Scope scope(Category::comm);
  s.grad = Tensor(shape, grad_type, params.memory());
  s.send = Tensor(shape, params.dtype(), params.memory());
  return s;
}

std::int64_t shard_elements(const ModelConfig& model, int stage, int ranks, int rank) {
  if (stage == 0) return model.params();
  if (stage == 1) return shard_range(model.params(), ranks, rank).length;
  return model.blocks * shard_range(model.block_params(), ranks, rank).length;
}

StateBytes formula_states(const ModelConfig& model, const RunConfig& run, int ranks, int rank) {
  const auto P = static_cast<std::uint64_t>(model.params());
  const auto S = static_cast<std::uint64_t>(shard_elements(model, run.stage, ranks, rank));
  const bool mixed = run.precision == Precision::mixed;
  const std::uint64_t w = mixed ? 2 : 4;  // bytes of a weight or a gradient
  StateBytes b;
  b.params = w * (run.stage >= 3 ? S : P);
  b.grads = w * (run.stage >= 2 ? S : P);
  const std::uint64_t owned = run.stage >= 1 ? S : P;
  b.master = mixed ? 4 * owned : 0;
  b.optimizer = run.sgd ? 0 : 8 * owned;
  return b;
}

std::uint64_t formula_comm_bytes(const ModelConfig& model, const RunConfig& run, int ranks,
                                 int rank) {
  const auto P = static_cast<std::uint64_t>(model.params());
  const auto N = static_cast<std::uint64_t>(ranks);
  const std::uint64_t w = run.precision == Precision::mixed ? 2 : 4;
  if (N == 1) return 0;
  // The shard a reduce-scatter leaves on this rank: of the flat buffer (stage 0's
  // allreduce cuts it as stage 1 does), or of each block (stages 2, 3).
  const auto S = static_cast<std::uint64_t>(shard_elements(model, std::max(run.stage, 1), ranks, rank));
  std::uint64_t elements = (N - 1) * S + (P - S);
  if (run.stage == 3) elements += P - S;  // parameters gathered twice: forward and backward
  return w * elements;
}

std::uint64_t formula_activations(const ModelConfig& model, const RunConfig& run) {
  const std::uint64_t w = run.precision == Precision::mixed ? 2 : 4;
  const auto per_block = static_cast<std::uint64_t>(model.batch) * model.width *
                         (run.checkpoint ? 1 : 5);
  return w * per_block * static_cast<std::uint64_t>(model.blocks);
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

/// One block's two weights, views of a flat block of 8 d^2 elements: W1 (d x 4d), W2.
struct Weights {
  Tensor w1, w2;
};
Weights weights_of(const Tensor& block, std::int64_t d) {
  return {block.view(0, Shape{d, 4 * d}), block.view(4 * d * d, Shape{4 * d, d})};
}

/// What a block's forward keeps: its input and (without checkpointing) its hidden
/// activation and output.
struct Kept {
  Tensor x, y1, y2;
};

Kept block_forward(const Tensor& x, const Weights& w) {
  Scope scope(Category::activations);
  Kept k{x, {}, {}};
  k.y1 = tanh(matmul(x, w.w1));  // f16: in f32, rounded once
  k.y2 = tanh(matmul(k.y1, w.w2));
  return k;
}

/// dL/dx of the block, and its weights' gradients written into `grad` (8 d^2 elements).
Tensor block_backward(const Kept& k, const Tensor& dy2, const Weights& w, Tensor& grad,
                      std::int64_t d) {
  Scope scope(Category::activations);
  Weights g = weights_of(grad, d);
  const Tensor dz2 = tanh_backward(k.y2, dy2);
  matmul_into(g.w2, k.y1, dz2, true, false);  // dW2 = y1^T dz2
  const Tensor dz1 = tanh_backward(k.y1, matmul(dz2, w.w2, false, true));
  matmul_into(g.w1, k.x, dz1, true, false);  // dW1 = x^T dz1
  return matmul(dz1, w.w1, false, true);
}

/// One rank's states for a run: what it keeps depends on the stage.
struct Rank {
  Communicator& comm;
  const ModelConfig& model;
  const RunConfig& run;
  DType type;  // of params, grads and activations
  Memory memory;
  std::int64_t P, PB, d;
  std::vector<std::size_t> block_counts;  // shard_counts(8 d^2, N): stages 2, 3
  ShardRange own;                          // this rank's range of a block: stages 2, 3

  Tensor params;  // stages 0-2: every parameter; stage 3: this rank's shard of each block
  Tensor grads;   // stages 0, 1: every gradient; stages 2, 3: this rank's shards
  Tensor master, m, v;  // stage 0: every parameter's; stages 2, 3: this rank's shards
  std::optional<Shard> zero1;  // stage 1
  std::vector<Kept> kept;

  Rank(Communicator& c, const ModelConfig& mc, const RunConfig& rc, Memory mem)
      : comm(c), model(mc), run(rc),
        type(rc.precision == Precision::mixed ? DType::f16 : DType::f32), memory(mem),
        P(mc.params()), PB(mc.block_params()), d(mc.width),
        block_counts(shard_counts(PB, c.size())), own(shard_range(PB, c.size(), c.rank())) {}

  std::int64_t S() const { return model.blocks * own.length; }
  /// Block b's range of this rank's shard buffers (stages 2, 3).
  Tensor shard_of(const Tensor& t, int b) const { return t.slice(b * own.length, own.length); }

  /// Every rank's and every stage's initial weights, W ~ N(0, 1 / fan_in), in the
  /// parameters' type: made before the ledger starts counting the run.
  static Tensor initial_weights(const ModelConfig& model, DType type, Memory memory) {
    const std::int64_t P = model.params(), PB = model.block_params(), d = model.width;
    Tensor init(Shape{P}, DType::f32);
    for (int b = 0; b < model.blocks; ++b) {
      const auto seed = model.seed * 1000003 + static_cast<std::uint64_t>(b);
      Weights w = weights_of(init.slice(b * PB, PB), d);
      w.w1.copy_from(scale(randn(Shape{d, 4 * d}, seed * 2 + 1), 1.0f / std::sqrt(static_cast<float>(d))));
      w.w2.copy_from(scale(randn(Shape{4 * d, d}, seed * 2 + 2), 1.0f / std::sqrt(4.0f * static_cast<float>(d))));
    }
    return cast(init, type).to(memory);
  }

  void allocate(const Tensor& full) {
    if (run.stage <= 2) {
      Scope scope(Category::params);
      params = full.clone();
    } else {
      Scope scope(Category::params);
      params = Tensor(Shape{S()}, type, memory);
      for (int b = 0; b < model.blocks; ++b)
        shard_of(params, b).copy_from(full.slice(b * PB + own.offset, own.length));
    }
    {
      Scope scope(Category::grads);
      grads = Tensor(Shape{run.stage >= 2 ? S() : P}, type, memory);
    }
    if (run.stage == 1) {
      zero1 = make_shard(comm, params, type);
      return;
    }
    // Stages 0, 2, 3: the optimizer's weights are the parameters themselves in fp32 (for
    // stage 2, block by block: see optimizer_weights), a f32 copy in mixed precision.
    const std::int64_t owned = run.stage == 0 ? P : S();
    if (type == DType::f32) {
      if (run.stage != 2) master = params;
    } else {
      {
        Scope scope(Category::master);
        master = run.stage == 0 ? cast(params, DType::f32) : Tensor(Shape{owned}, DType::f32, memory);
      }
      if (run.stage != 0)  // each block's range, through a temporary the size of one
        for (int b = 0; b < model.blocks; ++b)
          shard_of(master, b).copy_from(cast(full.slice(b * PB + own.offset, own.length), DType::f32));
    }
    if (run.sgd) return;
    Scope scope(Category::optimizer);
    m = Tensor(Shape{owned}, DType::f32, memory);
    v = Tensor(Shape{owned}, DType::f32, memory);
  }

  /// Stage 2 in fp32: block b's optimizer weights are this rank's range of the block in
  /// the (full) parameters; otherwise its range of `master`.
  Tensor optimizer_weights(int b) {
    if (run.stage == 2 && type == DType::f32) return params.slice(b * PB + own.offset, own.length);
    return shard_of(master, b);
  }

  // -- stage 3: every block's parameters are gathered before use, freed after ---------
  Request gather_start(int b, Tensor& into) {
    Scope scope(Category::comm);
    into = Tensor(Shape{PB}, type, memory);
    return comm.iallgatherv(shard_of(params, b), into, block_counts);
  }
  Tensor gather_now(int b) {
    Scope scope(Category::comm);
    Tensor into(Shape{PB}, type, memory);
    comm.allgatherv(shard_of(params, b), into, block_counts);
    return into;
  }

  /// Stage 3: the weights of each block in the order the step uses them (forward 0..L-1, then
  /// backward L-1..0), gathered one ahead when prefetching.
  struct Gatherer {
    Rank& rank;
    std::vector<int> order;
    std::size_t next = 0;
    Tensor ahead;
    Request pending;
    Tensor get() {
      Rank& R = rank;
      const int b = order[next++];
      Tensor now;
      if (!R.run.prefetch) {
        now = R.gather_now(b);
      } else {
        if (!pending.pending()) pending = R.gather_start(b, ahead);  // the first one
        R.comm.wait(pending);
        now = ahead;
        ahead = Tensor();
        if (next < order.size()) pending = R.gather_start(order[next], ahead);
      }
      return now;
    }
  };

  Weights block_weights(int b, Gatherer& g, Tensor& hold) {
    if (run.stage == 3) {
      hold = g.get();
      return weights_of(hold, d);
    }
    return weights_of(params.slice(b * PB, PB), d);
  }

  /// One training step on this rank's rows; returns its squared error.
  double step(const Tensor& x, const Tensor& y, int t, std::uint64_t* after_forward) {
    Gatherer g{*this, {}, 0, {}, {}};
    for (int b = 0; b < model.blocks; ++b) g.order.push_back(b);
    for (int b = model.blocks - 1; b >= 0; --b) g.order.push_back(b);
    // Forward.
    const std::uint64_t before = memory::usage().live(Category::activations);
    kept.assign(static_cast<std::size_t>(model.blocks), {});
    Tensor h = x;
    for (int b = 0; b < model.blocks; ++b) {
      Tensor hold;
      const Weights w = block_weights(b, g, hold);
      Kept k = block_forward(h, w);
      h = k.y2;
      kept[static_cast<std::size_t>(b)] = run.checkpoint ? Kept{k.x, {}, {}} : std::move(k);
    }
    if (after_forward) *after_forward = memory::usage().live(Category::activations) - before;
    // Loss: sum of squares over every rank's rows / (2 N B); its gradient (h - y) / (N B).
    Tensor dh;
    double sse = 0;
    {
      Scope scope(Category::activations);
      const Tensor h32 = cast(h, DType::f32), y32 = y;
      sse = nn::squared_error(h32, y32);
      dh = cast(nn::mse_backward(h32, y32, double(comm.size()) * model.batch), type);
    }
    // Backward, last block first; each block's gradients go where the stage keeps them.
    for (int b = model.blocks - 1; b >= 0; --b) {
      Tensor hold;
      const Weights w = block_weights(b, g, hold);
      Kept& k = kept[static_cast<std::size_t>(b)];
      if (run.checkpoint) k = block_forward(k.x, w);  // recompute: time for memory
      if (run.stage <= 1) {
        Tensor gb = grads.slice(b * PB, PB);
        dh = block_backward(k, dh, w, gb, d);
      } else {
        Tensor bucket;
        {
          Scope scope(Category::comm);
          bucket = Tensor(Shape{PB}, type, memory);
        }
        dh = block_backward(k, dh, w, bucket, d);
        comm.reduce_scatter(bucket, shard_of(grads, b), ReduceOp::sum);
      }
      k = Kept{};
    }
    update(t);
    return sse;
  }

  void update(int t) {
    if (run.stage == 0) {
      comm.allreduce(grads, ReduceOp::sum);
      if (run.sgd) {
        nn::sgd_step(master, grads, run.adam.lr);
      } else {
        ch05::adam_update(master, grads, m, v, t, run.adam);
      }
      if (type != DType::f32) params.copy_from(cast(master, type));
      return;
    }
    if (run.stage == 1) return zero1_step(comm, params, grads, *zero1, run.adam);
    for (int b = 0; b < model.blocks; ++b) {
      Tensor w = optimizer_weights(b), mb = shard_of(m, b), vb = shard_of(v, b);
      ch05::adam_update(w, shard_of(grads, b), mb, vb, t, run.adam);
      if (run.stage == 3) {  // this rank's parameters are its shard: no exchange
        if (type != DType::f32) shard_of(params, b).copy_from(cast(w, type));
        continue;
      }
      Tensor send;
      {
        Scope scope(Category::comm);
        send = cast(w, type);
      }
      comm.allgatherv(send, params.slice(b * PB, PB), block_counts);
    }
  }

  /// Every parameter's optimizer weights, f32, on every rank (uncounted).
  Tensor final_weights() {
    Communicator::Uncounted quiet(comm);
    if (run.stage == 0) return master.clone();
    Tensor all(Shape{P}, DType::f32, memory);
    if (run.stage == 1) {
      comm.allgatherv(zero1->master, all, shard_counts(P, comm.size()));
      return all;
    }
    for (int b = 0; b < model.blocks; ++b)
      comm.allgatherv(optimizer_weights(b), all.slice(b * PB, PB), block_counts);
    return all;
  }
};

}  // namespace

RunResult train(Communicator& comm, const ModelConfig& model, const RunConfig& run,
                Memory memory) {
  require(run.stage >= 0 && run.stage <= 3, [&] {
    return "train: ZeRO stage " + std::to_string(run.stage) + " (stages are 0, 1, 2, 3)";
  });
  require(!run.sgd || (run.stage == 0 && run.precision == Precision::fp32),
          [] { return "train: SGD runs at stage 0 in fp32 only"; });
  RunResult result;
  // This rank's rows of one data set: x ~ N(0, 1), y = tanh(x T) for a fixed random T.
  const int N = comm.size(), r = comm.rank();
  const std::int64_t d = model.width, B = model.batch;
  Tensor x, y;
  {
    const Tensor all_x = randn(Shape{N * B, d}, model.seed * 7919 + 17);
    const Tensor teacher = scale(randn(Shape{d, d}, model.seed * 7919 + 29), 1.0f / std::sqrt(static_cast<float>(d)));
    const Tensor all_y = tanh(matmul(all_x, teacher));
    x = cast(all_x.slice(r * B, B), run.precision == Precision::mixed ? DType::f16 : DType::f32)
            .to(memory);
    y = all_y.slice(r * B, B).clone().to(memory);
  }
  Tensor initial = Rank::initial_weights(model, run.precision == Precision::mixed ? DType::f16 : DType::f32, memory);
  memory::Tracker tracker;
  Rank rank(comm, model, run, memory);
  rank.allocate(initial);
  initial = Tensor();
  result.shard = run.stage == 0 ? model.params() : (run.stage == 1 ? rank.zero1->range.length : rank.S());
  const CommStats before = comm.stats();
  for (int t = 1; t <= run.steps; ++t) {
    comm.barrier();
    const auto start = Clock::now();
    const double sse = rank.step(x, y, t, t == 1 ? &result.activations_after_forward : nullptr);
    if (memory == Memory::device) cuda::synchronize();  // the clock stops when the GPU is done
    const double took = seconds_since(start);
    if (t == 1 && run.stage == 0 && run.keep_grads) result.first_grads = cast(rank.grads, DType::f32).to(Memory::host);
    result.fastest_step_s = t == 1 ? took : std::min(result.fastest_step_s, took);
    result.losses.push_back(comm.agree(sse, ReduceOp::sum) / (2.0 * N * static_cast<double>(B)));
  }
  result.comm = comm.stats().since(before);
  // The barriers of the loop are not part of training's traffic.
  result.comm[Op::barrier] = OpStats{};
  const memory::Usage u = tracker.usage();
  result.states = {u.live(Category::params), u.live(Category::grads), u.live(Category::master),
                   u.live(Category::optimizer)};
  result.usage = u;
  result.fastest_step_s = comm.agree(result.fastest_step_s, ReduceOp::max);
  result.weights = rank.final_weights().to(Memory::host);
  return result;
}

}  // namespace ch05

// Chapter 04: running a schedule on real ranks.
#include "pipeline.hpp"

#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <string>
#include <tuple>

#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"

namespace ch04 {

using shardlab::shard;
using shardlab::shard_range;
using Clock = std::chrono::steady_clock;

nn::Sequential make_blocks(nn::ParameterStore& store, const ModelConfig& cfg, int first, int last) {
  nn::Sequential blocks;
  for (int l = first; l < last; ++l) {
    blocks.add<nn::Linear>(store, "block" + std::to_string(l), cfg.width, cfg.width,
                           cfg.seed * 1000003 + static_cast<std::uint64_t>(l));
    blocks.add<nn::Tanh>();
  }
  return blocks;
}

BlockRange blocks_of(const ModelConfig& cfg, int virtual_stage, int virtual_stages) {
  const auto r = shard_range(cfg.layers, virtual_stages, virtual_stage);
  return {static_cast<int>(r.offset), static_cast<int>(r.offset + r.length)};
}

Batch make_batch(const ModelConfig& cfg) {
  const std::uint64_t seed = cfg.seed * 1000003 + 0xba7c4ull;
  return {shardlab::randn(cfg.batch, cfg.width, seed),
          shardlab::randn(cfg.batch, cfg.width, seed + 1)};
}

StageModel::StageModel(const ModelConfig& cfg, int stage, int stages, int chunks, Memory memory) {
  for (int c = 0; c < chunks; ++c) {
    const BlockRange r = blocks_of(cfg, virtual_stage(stage, c, stages), stages * chunks);
    chunks_.push_back(make_blocks(store_, cfg, r.first, r.last));
  }
  store_.allocate(memory);
}

namespace {

/// Tags say which microbatch and chunk a message is for, so that a schedule whose stages
/// disagree on the order gets the communicator's "tag mismatch" naming both.
int tag_of(int microbatch, int chunk, int chunks) { return (microbatch * chunks + chunk) % 32768; }

/// What a stage keeps of a microbatch between its ops.
struct InFlight {
  nn::Saved saved;  // what the chunk's forward kept for its backward
  Tensor out;       // the forward's output (the last stage: for the loss)
};

}  // namespace

StageRun run_schedule(Communicator& comm, const Schedule& s, StageModel& model,
                      const Batch& batch) {
  shardlab::require(s.stages == comm.size(), [&] {
    return "run_schedule: a schedule of " + std::to_string(s.stages) + " stages on " +
           std::to_string(comm.size()) + " ranks";
  });
  const int p = s.stages, st = comm.rank(), v = s.chunks, last = p * v - 1;
  const bool split = s.split_backward();
  const Memory memory = model.store().values().memory();
  const std::int64_t rows = batch.x.rows();
  // Activations flow on one channel, gradients on another: each keeps its own order.
  const std::unique_ptr<Communicator> forward_channel = comm.split(0, st);
  const std::unique_ptr<Communicator> backward_channel = comm.split(0, st);

  std::map<std::pair<int, int>, InFlight> held;  // (microbatch, chunk)
  std::deque<Tensor> sending;                    // buffers of the pending sends
  std::vector<shardlab::Request> sends;
  // A message to this very stage (one stage with several chunks) skips the communicator.
  std::map<std::pair<int, int>, Tensor> to_self_forward, to_self_backward;
  StageRun run;

  auto microbatch_rows = [&](int j) {
    const auto r = shard_range(rows, s.microbatches, j);
    return std::pair{r.offset, r.length};
  };
  auto receive = [&](Communicator& channel, std::map<std::pair<int, int>, Tensor>& to_self,
                     int from, int j, int c, std::int64_t n) {
    if (from == st) {
      const auto it = to_self.find({j, c});
      shardlab::require(it != to_self.end(), "run_schedule: a message to this stage went missing");
      Tensor t = it->second;
      to_self.erase(it);
      return t;
    }
    Tensor in = shardlab::empty({n, static_cast<std::int64_t>(batch.x.cols())},
                                shardlab::DType::f32, memory);
    channel.recv(in, from, tag_of(j, c, v));
    return in;
  };
  auto send = [&](Communicator& channel, std::map<std::pair<int, int>, Tensor>& to_self, int to,
                  int j, int c, const Tensor& t) {
    if (to == st) {
      to_self[{j, c}] = t;
      return;
    }
    sending.push_back(t);
    sends.push_back(channel.isend(sending.back(), to, tag_of(j, c, v)));
  };

  comm.barrier();
  const Clock::time_point t0 = Clock::now();
  auto since = [&](Clock::time_point t) { return std::chrono::duration<double>(t - t0).count(); };

  for (const Op& op : s.ops[static_cast<std::size_t>(st)]) {
    const int j = op.microbatch, c = op.chunk, vs = virtual_stage(st, c, p);
    const auto [offset, n] = microbatch_rows(j);
    try {
      Event e{st, op, 0, 0};
      switch (op.kind) {
        case Kind::forward: {
          Tensor in = vs == 0 ? batch.x.slice(offset, n).to(memory)
                              : receive(*forward_channel, to_self_forward, (vs - 1) % p, j, c, n);
          e.start = since(Clock::now());
          nn::Forward f = model.chunk(c).forward(in);
          InFlight& kept = held[{j, c}];
          kept.saved = std::move(f.saved);
          kept.out = f.out;
          if (vs < last) {
            const int next = (vs + 1) % p;
            send(*forward_channel, to_self_forward, next, j, (vs + 1) / p, f.out);
          }
          break;
        }
        case Kind::backward: {
          InFlight& kept = held.at({j, c});
          Tensor dy;
          if (vs == last) {
            e.start = since(Clock::now());
            const Tensor target = batch.y.slice(offset, n).to(memory);
            run.squared_error += nn::squared_error(kept.out, target);
            dy = nn::mse_backward(kept.out, target, static_cast<double>(rows));
          } else {
            dy = receive(*backward_channel, to_self_backward, (vs + 1) % p, j, c, n);
            e.start = since(Clock::now());
          }
          const Tensor dx = model.chunk(c).backward_input(dy, kept.saved);
          if (!split) model.chunk(c).backward_weight(kept.saved);
          if (vs > 0) send(*backward_channel, to_self_backward, (vs - 1) % p, j, (vs - 1) / p, dx);
          if (!split) held.erase({j, c});
          break;
        }
        case Kind::weight: {
          e.start = since(Clock::now());
          model.chunk(c).backward_weight(held.at({j, c}).saved);
          held.erase({j, c});
          break;
        }
      }
      // On a GPU the kernels run after their launch returns: wait for them, so that the
      // op's time is its own.
      if (memory == Memory::device) shardlab::cuda::synchronize();
      e.end = since(Clock::now());
      run.events.push_back(e);
    } catch (const shardlab::CommError& error) {
      throw shardlab::CommError("stage " + std::to_string(st) + ", op " + label(op, v) +
                                " of the " + s.name + " schedule: " + error.what());
    }
  }
  comm.wait_all(sends);
  run.bytes_sent =
      forward_channel->stats().total().bytes_sent + backward_channel->stats().total().bytes_sent;
  return run;
}

std::uint64_t formula_bytes(const ModelConfig& cfg, int stages, int chunks) {
  if (stages == 1) return 0;
  return 2ull * static_cast<std::uint64_t>(stages * chunks - 1) *
         static_cast<std::uint64_t>(cfg.batch) * static_cast<std::uint64_t>(cfg.width) * 4ull;
}

void run_reference(const ModelConfig& cfg, const Batch& batch, Reference& out) {
  out.model = make_blocks(out.store, cfg, 0, cfg.layers);
  out.store.allocate();
  nn::Forward f = out.model.forward(batch.x);
  out.squared_error = nn::squared_error(f.out, batch.y);
  out.model.backward(nn::mse_backward(f.out, batch.y, static_cast<double>(cfg.batch)), f.saved);
}

double max_gradient_diff(StageModel& model, Reference& ref) {
  std::map<std::string, nn::Parameter*> by_name;
  for (nn::Parameter* p : ref.store.parameters()) by_name[p->name] = p;
  double worst = 0;
  for (nn::Parameter* p : model.store().parameters()) {
    const nn::Parameter* r = by_name.at(p->name);
    const double d = shardlab::max_abs_diff(p->grad.to(Memory::host), r->grad);
    if (std::isnan(d)) return d;
    worst = std::max(worst, d);
  }
  return worst;
}

std::function<double(int, const Op&)> measured_costs(const std::vector<Event>& events) {
  std::map<std::tuple<int, Kind, int, int>, double> took;
  for (const Event& e : events)
    took[{e.stage, e.op.kind, e.op.microbatch, e.op.chunk}] = e.end - e.start;
  return [took](int stage, const Op& op) {
    const auto it = took.find({stage, op.kind, op.microbatch, op.chunk});
    return it == took.end() ? 0.0 : it->second;
  };
}

}  // namespace ch04

// Chapter 04: the pipeline runtime (pipeline.hpp).
#include "pipeline.hpp"

#include <deque>
#include <map>
#include <string>
#include <tuple>

#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/timer.hpp"
#include "timeline.hpp"

namespace ch04 {

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

Pipeline::Pipeline(Communicator& comm)
    : comm_(comm),
      forward_(comm.split(0, comm.rank())),
      backward_(comm.split(0, comm.rank())),
      one_clock_(shardlab::one_machine(comm)) {}

Pipeline::~Pipeline() = default;

StageRun Pipeline::run(const Schedule& s, const Stage& stage, const Hooks& hooks) {
  const int p = s.stages, st = comm_.rank(), v = s.chunks, last = p * v - 1;
  shardlab::require(p == comm_.size() && static_cast<int>(stage.chunks.size()) == v, [&] {
    return "Pipeline::run: the " + s.name + " schedule of " + std::to_string(p) + " stages x " +
           std::to_string(v) + " chunks on " + std::to_string(comm_.size()) +
           " ranks, a stage of " + std::to_string(stage.chunks.size()) + " chunks";
  });
  shardlab::require(st != 0 || stage.input, "Pipeline::run: stage 0 has no input");
  shardlab::require(st != last % p || stage.loss, [&] {
    return "Pipeline::run: stage " + std::to_string(st) + " (the last virtual stage) has no loss";
  });
  shardlab::require(last == 0 || stage.boundary, "Pipeline::run: the stage has no boundary");
  const bool split = s.split_backward();
  const auto& ops = s.ops[static_cast<std::size_t>(st)];
  // The ops that add weight gradients: the last one gets the hook before it, and each
  // chunk's count says when its gradients are final.
  const Kind adds_weights = split ? Kind::weight : Kind::backward;
  std::size_t last_backward = ops.size();
  std::vector<int> backwards_left(static_cast<std::size_t>(v), 0);
  for (std::size_t i = 0; i < ops.size(); ++i)
    if (ops[i].kind == adds_weights) {
      last_backward = i;
      ++backwards_left[static_cast<std::size_t>(ops[i].chunk)];
    }

  std::map<std::pair<int, int>, InFlight> held;  // (microbatch, chunk)
  std::deque<Tensor> sending;                    // buffers of the pending sends
  std::vector<shardlab::Request> sends;
  // A message to this very stage (one stage with several chunks) skips the communicator.
  std::map<std::pair<int, int>, Tensor> to_self_forward, to_self_backward;
  const std::uint64_t sent_before =
      forward_->stats().total().bytes_sent + backward_->stats().total().bytes_sent;
  StageRun run;

  // Receives what enters chunk c for microbatch j, of shape `want`.
  auto receive = [&](Communicator& channel, std::map<std::pair<int, int>, Tensor>& to_self,
                     int from, int j, int c, const Boundary& want) {
    if (from != st) {
      Tensor in = shardlab::empty(want.shape, want.dtype, stage.memory);
      channel.recv(in, from, tag_of(j, c, v));
      return in;
    }
    const auto it = to_self.find({j, c});
    shardlab::require(it != to_self.end(), "a message to this stage went missing");
    Tensor t = it->second;
    to_self.erase(it);
    shardlab::require(t.shape() == want.shape && t.dtype() == want.dtype, [&] {
      return "chunk " + std::to_string(c) + " gets a " + t.shape().str() +
             " tensor, its boundary says " + want.shape.str();
    });
    return t;
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

  auto where = [&](const Op& op) {
    return "stage " + std::to_string(st) + ", op " + label(op, v) + " of the " + s.name +
           " schedule: ";
  };

  comm_.barrier();
  const shardlab::Stopwatch clock;
  // When an op's computation is over. On a GPU the kernels run after their launch
  // returns: wait for them, so that the op's time is its own. The send of its result
  // comes after: it is communication, as the wait for its input was.
  auto finished = [&] {
    if (stage.memory == Memory::device) shardlab::cuda::synchronize();
    return clock.seconds();
  };
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    const int j = op.microbatch, c = op.chunk, k = virtual_stage(st, c, p);
    nn::Layer& chunk = *stage.chunks[static_cast<std::size_t>(c)];
    try {
      if (i == last_backward && hooks.before_last_backward) hooks.before_last_backward();
      Event e{st, op, 0, 0};
      switch (op.kind) {
        case Kind::forward: {
          Tensor in =
              k == 0 ? stage.input(j)
                     : receive(*forward_, to_self_forward, (k - 1) % p, j, c, stage.boundary(j, c));
          e.start = clock.seconds();
          nn::Forward f = chunk.forward(in);
          e.end = finished();
          InFlight& kept = held[{j, c}];
          kept.saved = std::move(f.saved);
          kept.out = f.out;
          if (k < last) send(*forward_, to_self_forward, (k + 1) % p, j, (k + 1) / p, f.out);
          break;
        }
        case Kind::backward: {
          InFlight& kept = held.at({j, c});
          Tensor dy;
          if (k == last) {
            e.start = clock.seconds();
            MicrobatchLoss loss = stage.loss(kept.out, j);
            shardlab::require(loss.grad.shape() == kept.out.shape(), [&] {
              return "the loss gives a " + loss.grad.shape().str() + " gradient for a " +
                     kept.out.shape().str() + " output";
            });
            run.loss += loss.value;
            dy = std::move(loss.grad);
          } else {
            // The gradient of this chunk's output: the output's shape and type.
            dy = receive(*backward_, to_self_backward, (k + 1) % p, j, c,
                         {kept.out.shape(), kept.out.dtype()});
            e.start = clock.seconds();
          }
          const Tensor dx = chunk.backward_input(dy, kept.saved);
          if (!split) chunk.backward_weight(kept.saved);
          e.end = finished();
          if (k > 0) send(*backward_, to_self_backward, (k - 1) % p, j, (k - 1) / p, dx);
          if (!split) held.erase({j, c});
          break;
        }
        case Kind::weight: {
          e.start = clock.seconds();
          chunk.backward_weight(held.at({j, c}).saved);
          e.end = finished();
          held.erase({j, c});
          break;
        }
      }
      run.events.push_back(e);
      if (op.kind == adds_weights && hooks.after_backward)
        hooks.after_backward(j, c, --backwards_left[static_cast<std::size_t>(c)] == 0);
    } catch (const shardlab::CommAborted&) {
      throw;  // another rank failed: its own error is the one to report
    } catch (const shardlab::CommError& error) {
      throw shardlab::CommError(where(op) + error.what());
    } catch (const shardlab::Error& error) {
      throw shardlab::Error(where(op) + error.what());
    }
  }
  comm_.wait_all(sends);
  // Every rank's times from one origin, the earliest rank's start. The ranks leave the
  // barrier at slightly different moments (a thread can lose its core just after it), and
  // times counted from each rank's own start would shift its ops against the others' —
  // and the fastest of several runs (time_schedule) would favour the most shifted. Where
  // the ranks share a clock it is measured and taken out; across machines each rank's own
  // start is what there is.
  if (one_clock_) {
    const auto mine = clock.started().time_since_epoch();
    const std::int64_t started = std::chrono::duration_cast<std::chrono::nanoseconds>(mine).count();
    shardlab::Communicator::Uncounted quiet(comm_);
    const std::int64_t first = comm_.agree(started, shardlab::ReduceOp::min);
    const double late = static_cast<double>(started - first) * 1e-9;
    for (Event& e : run.events) e.start += late, e.end += late;
  }
  run.bytes_sent =
      forward_->stats().total().bytes_sent + backward_->stats().total().bytes_sent - sent_before;
  return run;
}

std::string bubble_caption() {
  return "the pipeline's bubble (idle / busy time): measured, chapter 04's simulation with the "
         "measured op times, and the schedule's formula (for gpipe, 1f1b and interleaved "
         "whatever t_b / t_f; zb1's at t_f = t_b = t_w)";
}

shardlab::Table bubble_table(const Schedule& s, const std::vector<Event>& events) {
  const bool split = s.split_backward();
  const Timeline measured = timeline_of(events, s.stages, s.chunks, split);
  const Timeline simulated = simulate(s, measured_costs(events));
  const Formula formula = formula_for(s, split ? Costs{1, 1, 1} : Costs{}, s.microbatches);
  shardlab::Table t(
      {"schedule", "measured_bubble_over_ideal", "simulated", "formula", "formula_text"});
  t.add({s.name, measured.bubble_over_ideal(), simulated.bubble_over_ideal(), formula.over_ideal,
         formula.text});
  return t;
}

Timed time_schedule(Pipeline& pipeline, const Schedule& s, const Stage& stage,
                    const std::function<void()>& reset, int rounds) {
  reset();
  (void)pipeline.run(s, stage);
  Timed best;
  for (int round = 0; round < rounds; ++round) {
    reset();
    StageRun attempt = pipeline.run(s, stage);
    std::vector<Event> all = gather_events(pipeline.comm(), attempt.events);
    Timeline t = timeline_of(all, s.stages, s.chunks, s.split_backward());
    if (round == 0 || t.makespan < best.timeline.makespan)
      best = {std::move(attempt), std::move(all), std::move(t)};
  }
  return best;
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

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

/// Messages between stages on one channel (forward's activations, or backward's
/// gradients): sends are non-blocking, completed by finish(); a message to this very stage
/// (one stage with several chunks) skips the communicator.
class Channel {
 public:
  Channel(Communicator& comm, int stage, int chunks, Memory memory)
      : comm_(comm), stage_(stage), chunks_(chunks), memory_(memory) {}
  /// What enters chunk c for microbatch j, from stage `from`, of shape `want`.
  Tensor receive(int from, int j, int c, const Boundary& want) {
    if (from != stage_) {
      const auto posted = early_.find({j, c});
      if (posted == early_.end()) post(from, j, c, want);
      auto& [in, request] = early_.at({j, c});
      comm_.wait(request);
      Tensor out = std::move(in);
      early_.erase({j, c});
      return out;
    }
    const auto it = to_self_.find({j, c});
    shardlab::require(it != to_self_.end(), "a message to this stage went missing");
    Tensor t = it->second;
    to_self_.erase(it);
    shardlab::require(t.shape() == want.shape && t.dtype() == want.dtype, [&] {
      return "chunk " + std::to_string(c) + " gets a " + t.shape().str() +
             " tensor, its boundary says " + want.shape.str();
    });
    return t;
  }
  /// Posts the receive of what enters chunk c for microbatch j from stage `from` (not this
  /// one), for receive() to wait for.
  void post(int from, int j, int c, const Boundary& want) {
    Tensor in = shardlab::empty(want.shape, want.dtype, memory_);
    shardlab::Request request = comm_.irecv(in, from, tag_of(j, c, chunks_));
    early_.emplace(std::pair{j, c}, std::pair{std::move(in), std::move(request)});
  }
  /// post(), unless `from` is this stage or the receive is posted already; `want` gives
  /// the shape.
  void post_once(int from, int j, int c, const std::function<Boundary()>& want) {
    if (from != stage_ && !early_.count({j, c})) post(from, j, c, want());
  }
  /// `t` to chunk c of stage `to`, for microbatch j.
  void send(int to, int j, int c, const Tensor& t) {
    if (to == stage_) {
      to_self_[{j, c}] = t;
      return;
    }
    sending_.push_back(t);
    sends_.push_back(comm_.isend(sending_.back(), to, tag_of(j, c, chunks_)));
  }
  /// Waits for every send.
  void finish() { comm_.wait_all(sends_); }

 private:
  Communicator& comm_;
  int stage_, chunks_;
  Memory memory_;
  std::map<std::pair<int, int>, Tensor> to_self_;
  std::map<std::pair<int, int>, std::pair<Tensor, shardlab::Request>> early_;  // posted receives
  std::deque<Tensor> sending_;  // buffers of the pending sends
  std::vector<shardlab::Request> sends_;
};

/// One stage's run of a schedule, op by op, each an F, a B or a W on chunk c of
/// microbatch j (virtual stage k = c p + s), timed into an Event.
class StageRunner {
 public:
  StageRunner(const Schedule& s, const Stage& stage, int st, Communicator& forward,
              Communicator& backward)
      : stage_(stage),
        st_(st),
        p_(s.stages),
        last_(s.stages * s.chunks - 1),
        split_(s.split_backward()),
        forward_(forward, st, s.chunks, stage.memory),
        backward_(backward, st, s.chunks, stage.memory) {}

  /// Starts the clock the ops are timed by (when the stages leave their barrier).
  void start() { clock_.restart(); }
  /// Runs `op` (a B on the last virtual stage adds its loss to run.loss).
  Event run(const Op& op, StageRun& run) {
    Event e{st_, op, 0, 0};
    nn::Layer& chunk = *stage_.chunks[static_cast<std::size_t>(op.chunk)];
    const int k = virtual_stage(st_, op.chunk, p_);
    switch (op.kind) {
      case OpKind::forward:
        forward_op(op, k, chunk, e);
        break;
      case OpKind::backward:
        backward_op(op, k, chunk, e, run);
        break;
      case OpKind::weight:
        e.start = clock_.seconds();
        chunk.backward_weight(held_.at({op.microbatch, op.chunk}).saved);
        e.end = finished();
        held_.erase({op.microbatch, op.chunk});
        break;
    }
    return e;
  }
  /// Posts the receive `op` waits for (Stage::early_receives), unless it has none, is
  /// posted already, or its shape is not known yet (a B whose F has not run).
  void post_receive(const Op& op) {
    const int j = op.microbatch, c = op.chunk, k = virtual_stage(st_, c, p_);
    if (op.kind == OpKind::forward && k > 0)
      forward_.post_once((k - 1) % p_, j, c, [&] { return stage_.boundary(j, c); });
    if (op.kind != OpKind::backward || k == last_) return;
    const auto kept = held_.find({j, c});
    if (kept == held_.end()) return;
    const Tensor& out = kept->second.out;
    backward_.post_once((k + 1) % p_, j, c, [&] { return Boundary{out.shape(), out.dtype()}; });
  }
  /// Waits for the sends still in flight.
  void finish() {
    forward_.finish();
    backward_.finish();
  }
  /// The clock of the ops' times.
  const shardlab::Stopwatch& clock() const { return clock_; }

 private:
  /// F: the input (stage 0's, or the previous virtual stage's output) through the chunk,
  /// its output on to the next virtual stage.
  void forward_op(const Op& op, int k, nn::Layer& chunk, Event& e) {
    const int j = op.microbatch, c = op.chunk;
    Tensor in =
        k == 0 ? stage_.input(j) : forward_.receive((k - 1) % p_, j, c, stage_.boundary(j, c));
    e.start = clock_.seconds();
    nn::Forward f = chunk.forward(in);
    e.end = finished();
    InFlight& kept = held_[{j, c}];
    kept.saved = std::move(f.saved);
    kept.out = f.out;
    if (k < last_) forward_.send((k + 1) % p_, j, (k + 1) / p_, f.out);
  }
  /// B: the output's gradient (the loss's, on the last virtual stage) back through the
  /// chunk, and through its weights too unless the schedule splits them off as W; dL/dx
  /// on to the virtual stage before.
  void backward_op(const Op& op, int k, nn::Layer& chunk, Event& e, StageRun& run) {
    const int j = op.microbatch, c = op.chunk;
    InFlight& kept = held_.at({j, c});
    Tensor dy;
    if (k == last_) {
      e.start = clock_.seconds();
      MicrobatchLoss loss = stage_.loss(kept.out, j);
      shardlab::require(loss.grad.shape() == kept.out.shape(), [&] {
        return "the loss gives a " + loss.grad.shape().str() + " gradient for a " +
               kept.out.shape().str() + " output";
      });
      run.loss += loss.value;
      dy = std::move(loss.grad);
    } else {  // the gradient of this chunk's output: the output's shape and type
      dy = backward_.receive((k + 1) % p_, j, c, {kept.out.shape(), kept.out.dtype()});
      e.start = clock_.seconds();
    }
    const Tensor dx = chunk.backward_input(dy, kept.saved);
    if (!split_) chunk.backward_weight(kept.saved);
    e.end = finished();
    if (k > 0) backward_.send((k - 1) % p_, j, (k - 1) / p_, dx);
    if (!split_) held_.erase({j, c});
  }
  /// When an op's computation is over. On a GPU the kernels run after their launch
  /// returns: wait for them, so that the op's time is its own. The send of its result
  /// comes after: it is communication, as the wait for its input was.
  double finished() const {
    if (stage_.memory == Memory::device) shardlab::cuda::synchronize();
    return clock_.seconds();
  }

  const Stage& stage_;
  int st_, p_, last_;
  bool split_;
  Channel forward_, backward_;
  std::map<std::pair<int, int>, InFlight> held_;  // (microbatch, chunk)
  shardlab::Stopwatch clock_;
};

/// Checks that `stage` can run `s` on `comm`'s ranks: the stages, the chunks, stage 0's
/// input, the last virtual stage's loss, the boundary.
/// "stage 1, op F3 of the 1f1b schedule: ", the start of an error raised by an op.
std::string where(const Schedule& s, int stage, const Op& op) {
  return "stage " + std::to_string(stage) + ", op " + label(op, s.chunks) + " of the " + s.name +
         " schedule: ";
}

void check_run(const Schedule& s, const Stage& stage, Communicator& comm) {
  const int p = s.stages, st = comm.rank(), v = s.chunks, last = p * v - 1;
  shardlab::require(p == comm.size() && static_cast<int>(stage.chunks.size()) == v, [&] {
    return "Pipeline::run: the " + s.name + " schedule of " + std::to_string(p) + " stages x " +
           std::to_string(v) + " chunks on " + std::to_string(comm.size()) + " ranks, a stage of " +
           std::to_string(stage.chunks.size()) + " chunks";
  });
  shardlab::require(st != 0 || stage.input, "Pipeline::run: stage 0 has no input");
  shardlab::require(st != last % p || stage.loss, [&] {
    return "Pipeline::run: stage " + std::to_string(st) + " (the last virtual stage) has no loss";
  });
  shardlab::require(last == 0 || stage.boundary, "Pipeline::run: the stage has no boundary");
}

/// Every rank's times from one origin, the earliest rank's start. The ranks leave the
/// barrier at slightly different moments (a thread can lose its core just after it), and
/// times counted from each rank's own start would shift its ops against the others' — and
/// the fastest of several runs (time_schedule) would favour the most shifted.
void align_clocks(Communicator& comm, const shardlab::Stopwatch& clock,
                  std::vector<Event>& events) {
  const auto mine = clock.started().time_since_epoch();
  const std::int64_t started = std::chrono::duration_cast<std::chrono::nanoseconds>(mine).count();
  shardlab::Communicator::Uncounted not_counted(comm);
  const std::int64_t first = comm.agree(started, shardlab::ReduceOp::min);
  const double late = static_cast<double>(started - first) * 1e-9;
  for (Event& e : events) e.start += late, e.end += late;
}

}  // namespace

Pipeline::Pipeline(Communicator& comm)
    : comm_(comm),
      forward_(comm.split(0, comm.rank())),
      backward_(comm.split(0, comm.rank())),
      one_clock_(shardlab::one_machine(comm)) {}

Pipeline::~Pipeline() = default;

StageRun Pipeline::run(const Schedule& s, const Stage& stage, const Hooks& hooks) {
  check_run(s, stage, comm_);
  const int st = comm_.rank();
  const auto& ops = s.ops[static_cast<std::size_t>(st)];
  // The ops that add weight gradients: the last one gets the hook before it, and each
  // chunk's count says when its gradients are final.
  const OpKind adds_weights = s.split_backward() ? OpKind::weight : OpKind::backward;
  std::size_t last_backward = ops.size();
  std::vector<int> backwards_left(static_cast<std::size_t>(s.chunks), 0);
  for (std::size_t i = 0; i < ops.size(); ++i)
    if (ops[i].kind == adds_weights) {
      last_backward = i;
      ++backwards_left[static_cast<std::size_t>(ops[i].chunk)];
    }
  const std::uint64_t sent_before =
      forward_->stats().total().bytes_sent + backward_->stats().total().bytes_sent;
  StageRun run;
  StageRunner runner(s, stage, st, *forward_, *backward_);
  comm_.barrier();
  runner.start();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    try {
      if (stage.early_receives) {  // this op's receive, then the next one's, in op order
        runner.post_receive(op);
        if (i + 1 < ops.size()) runner.post_receive(ops[i + 1]);
      }
      if (i == last_backward && hooks.before_last_backward) hooks.before_last_backward();
      run.events.push_back(runner.run(op, run));
      if (op.kind == adds_weights && hooks.after_backward)
        hooks.after_backward(op.microbatch, op.chunk,
                             --backwards_left[static_cast<std::size_t>(op.chunk)] == 0);
    } catch (const shardlab::CommAborted&) {
      throw;  // another rank failed: its own error is the one to report
    } catch (const shardlab::CommError& error) {
      throw shardlab::CommError(where(s, st, op) + error.what());
    } catch (const shardlab::Error& error) {
      throw shardlab::Error(where(s, st, op) + error.what());
    }
  }
  runner.finish();
  // Where the ranks share a clock it is measured and taken out; across machines each
  // rank's own start is what there is.
  if (one_clock_) align_clocks(comm_, runner.clock(), run.events);
  run.bytes_sent =
      forward_->stats().total().bytes_sent + backward_->stats().total().bytes_sent - sent_before;
  return run;
}

std::string bubble_caption() {
  return "the pipeline's bubble (idle / busy time): measured, chapter 04's simulation with the "
         "measured op times, and the schedule's formula (for gpipe, 1f1b and interleaved "
         "whatever t_b / t_f; ZB-H1's at t_f = t_b = t_w)";
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
  std::map<std::tuple<int, OpKind, int, int>, double> took;
  for (const Event& e : events)
    took[{e.stage, e.op.kind, e.op.microbatch, e.op.chunk}] = e.end - e.start;
  return [took](int stage, const Op& op) {
    const auto it = took.find({stage, op.kind, op.microbatch, op.chunk});
    return it == took.end() ? 0.0 : it->second;
  };
}

}  // namespace ch04

// Chapter 09's training (train.hpp).
#include "train.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <numeric>

#include "profile.hpp"
#include "shardlab/check.hpp"
#include "shardlab/format.hpp"
#include "shardlab/memory.hpp"
#include "shardlab/results.hpp"

namespace ch09 {

namespace memory = shardlab::memory;
using ch08::Axis;
using shardlab::ReduceOp;
using shardlab::require;
using shardlab::require_usage;
using shardlab::shard_range;

namespace {
/// --precision's names of the element types.
const char* precision_name(shardlab::DType type) {
  return type == shardlab::DType::f16 ? "fp16" : type == shardlab::DType::bf16 ? "bf16" : "fp32";
}

/// The axes --overlap names, in its list's order.
constexpr Axis kOverlapping[] = {Axis::dp, Axis::pp, Axis::ep, Axis::cp, Axis::tp};

/// A layer of a chunk whose gradients are announced as soon as its backward has made
/// them. Unless the schedule splits the backward (B and W as ops of their own), the
/// layer's weight gradients are made right after its input gradient, layer by layer (as
/// autograd does), instead of the chunk's B for every layer and then its W for every layer:
/// the same products in another order, so the last layers' buckets can go while the first
/// layers' backward still runs. Its forward first waits for its weights (`before`: ZeRO-1's
/// all-gather of the last step's update, still on its way while the earlier layers ran).
class Announced final : public nn::Layer {
 public:
  Announced(std::shared_ptr<nn::Layer> inner, bool eager, std::function<void(nn::Layer&)> done,
            std::function<void(const nn::Layer&)> before)
      : inner_(std::move(inner)),
        eager_(eager),
        done_(std::move(done)),
        before_(std::move(before)) {}
  std::string name() const override { return inner_->name(); }
  nn::Forward forward(const Tensor& x) const override {
    before_(*inner_);
    return inner_->forward(x);
  }
  Tensor backward_input(const Tensor& dy, nn::Saved& saved) const override {
    Tensor dx = inner_->backward_input(dy, saved);
    if (eager_) {
      inner_->backward_weight(saved);
      done_(*inner_);
    }
    return dx;
  }
  void backward_weight(nn::Saved& saved) override {
    if (eager_) return;  // made in backward_input
    inner_->backward_weight(saved);
    done_(*inner_);
  }
  std::vector<nn::Parameter*> parameters() const override { return inner_->parameters(); }

 private:
  std::shared_ptr<nn::Layer> inner_;
  bool eager_;
  std::function<void(nn::Layer&)> done_;
  std::function<void(const nn::Layer&)> before_;
};
}  // namespace

ch08::PerAxis<bool> overlap_of(const std::string& list) {
  ch08::PerAxis<bool> on;
  if (list == "none") return on;
  if (list == "all") {
    for (Axis a : kOverlapping) on[a] = true;
    return on;
  }
  std::string names;
  for (Axis a : kOverlapping)
    names += (names.empty() ? "" : ", ") + std::string(ch08::axis_name(a));
  std::size_t at = 0;
  while (at <= list.size()) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    const std::string name = list.substr(at, comma - at);
    at = comma + 1;
    bool found = false;
    for (Axis a : kOverlapping)
      if (ch08::axis_name(a) == name) found = on[a] = true;
    if (found) continue;
    throw shardlab::UsageError("--overlap: '" + name + "' is not all, none, or a list of " + names);
  }
  return on;
}

std::string overlap_name(const ch08::PerAxis<bool>& overlap) {
  std::string out;
  for (Axis a : kOverlapping)
    if (overlap[a]) out += (out.empty() ? "" : ",") + std::string(ch08::axis_name(a));
  return out.empty() ? "none" : out;
}

void set_precision(TrainConfig& c, const std::string& precision, const std::string& scaler) {
  c.precision = shardlab::DType::f32;
  for (shardlab::DType type : {shardlab::DType::f16, shardlab::DType::bf16})
    if (precision == precision_name(type)) c.precision = type;
  const std::string kind =
      !scaler.empty() ? scaler : (c.precision == shardlab::DType::f16 ? "dynamic" : "none");
  c.scaler = kind == "dynamic"  ? ch06::Scaler::dynamic
             : kind == "static" ? ch06::Scaler::fixed
                                : ch06::Scaler::none;
  require_usage(
      c.scaler == ch06::Scaler::none || c.precision != shardlab::DType::f32,
      "--scaler " + kind + ": a loss scaler is for 16-bit products (add --precision fp16)");
}

void check_config(const TrainConfig& c) {
  check_shape(c.model, c.mesh, c.chunks, c.context.get());
  require_usage(c.chunks == 1 || ch04::schedule_info(c.schedule).chunked,
                "--chunks " + std::to_string(c.chunks) + ": the " + c.schedule +
                    " schedule runs one chunk per stage");
  ch04::require_shape(c.schedule, c.mesh.pp, c.microbatches, c.chunks, c.model.layers);
  const std::int64_t tokens = c.model.context / c.mesh.cp;  // of a sequence, on one cp rank
  require_usage(!c.sequence_parallel || tokens % c.mesh.tp == 0,
                "--sequence-parallel splits each sequence's " + std::to_string(tokens) + " tokens" +
                    (c.mesh.cp > 1 ? " on a cp rank" : "") + " over the tp ranks: --tp " +
                    std::to_string(c.mesh.tp) + " must divide " +
                    (c.mesh.cp > 1 ? "--context / --cp" : "--context"));
  const std::string replicas = c.mesh.ep > 1 ? "dp x ep x m" : "dp x m";
  require_usage(c.batch >= static_cast<std::int64_t>(c.replicas()) * c.microbatches,
                "--batch " + std::to_string(c.batch) +
                    " must give every replica's microbatches a sequence: at least " + replicas +
                    " = " + std::to_string(c.replicas() * c.microbatches));
}

Trainer::Trainer(Mesh& mesh, GptModel& model, const TrainConfig& c, const Corpus& data)
    : mesh_(mesh),
      model_(model),
      c_(c),
      data_(data),
      schedule_(ch04::make_schedule(c.schedule, c.mesh.pp, c.microbatches, c.chunks)),
      pipeline_(mesh.pp()),
      scaler_(c.scaler, c.scaler_config) {
  const Coords& at = mesh.coords();
  // The embedding group: the first and the last stage of each place on the other axes
  // share wte (its colour: the first stage's rank there).
  const bool ends = at.pp == 0 || at.pp == c.mesh.pp - 1;
  Coords first_stage = at;
  first_stage.pp = 0;
  const int world = mesh.world().size();
  embedding_group_ = mesh.world().split(
      ends ? ch08::rank_of(c.mesh, first_stage) : world + mesh.world().rank(), at.pp);
  memory::Scope scope(memory::Category::optimizer);
  replicas_ = std::make_unique<ch08::ReplicaOptimizer>(mesh.replicas(), model.store(), c.zero,
                                                       c.adam, false, c.memory);
  // The experts: one optimizer of their own, over the ranks that hold the same experts.
  if (c.model.experts > 0)
    experts_ = std::make_unique<ch08::ReplicaOptimizer>(
        mesh.expert_replicas(), model.expert_store(), c.zero, c.adam, false, c.memory);
  // The gradients in c.buckets buckets per store, the last layers' first (DDP's and
  // Megatron-LM's order), overlapping or not: the same buckets either way, so the same sums.
  const bool overlap = c.overlap[Axis::dp];
  auto bucket_bytes = [&](const nn::ParameterStore& store) {
    return (4 * store.size() + c.buckets - 1) / c.buckets;
  };
  replicas_->set_buckets(bucket_bytes(model.store()), overlap);
  if (experts_) experts_->set_buckets(bucket_bytes(model.expert_store()), overlap);
  if (!overlap) return;
  // ZeRO-1: the gradients sync_gradients() still adds to after backward (wte's two copies,
  // sequence parallelism's whole weights) wait for it; their buckets are reduced after it.
  if (c.zero != 0) {
    std::vector<nn::Parameter*> late;
    if (c.mesh.pp > 1 && model.tied()) late.push_back(model.tied());
    const std::vector<nn::Parameter*> params = model.store().parameters();
    for (std::size_t i = 0; i < params.size(); ++i)
      if (model.sequence_parallel() && model.pieces()[i].summed_over_tp())
        late.push_back(params[i]);
    replicas_->set_late(late);
  }
  const bool eager = !schedule_.split_backward();
  for (int k = 0; k < model.chunks(); ++k) {
    const nn::Sequential& chunk = model.chunk(k);
    auto& run =
        announced_.emplace_back(std::make_unique<nn::Sequential>(chunk.slice(0, chunk.size())));
    for (std::size_t i = 0; i < chunk.size(); ++i)
      run->set(
          i, std::make_shared<Announced>(
                 chunk.layer(i), eager, [this](nn::Layer& layer) { announce(layer.parameters()); },
                 [this](const nn::Layer& layer) { weights_ready(layer.parameters()); }));
  }
}

std::uint64_t Trainer::values_in_flight_sent() const {
  return replicas_->values_in_flight_sent() + (experts_ ? experts_->values_in_flight_sent() : 0);
}

DpBuckets Trainer::dp_buckets() const {
  return {replicas_->bucket_elements(),
          experts_ ? experts_->bucket_elements() : std::vector<std::int64_t>{}};
}

void Trainer::weights_ready(const std::vector<nn::Parameter*>& params) {
  replicas_->wait_values(params);
  if (experts_) experts_->wait_values(params);
}

nn::Layer& Trainer::chunk_to_run(int c) {
  if (announced_.empty()) return model_.chunk(c);
  return *announced_.at(static_cast<std::size_t>(c));
}

void Trainer::announce(const std::vector<nn::Parameter*>& params) {
  if (local_gradients_) local_gradients_(params);
  for (const nn::Parameter* p : params) {
    replicas_->ready(*p);
    if (experts_) experts_->ready(*p);
  }
}

Trainer::~Trainer() = default;

// ---------------------------------------------------------------------------
// A step

/// What a step measures besides its work: the bytes each axis sends (one AxisMeter, the
/// pipeline's channels and the embedding group as pp), where the time goes (a
/// StepRecorder, when the step is profiled), and the routing of the MoE blocks (their log,
/// cleared and weighted for the step).
class Trainer::Meter {
 public:
  Meter(Trainer& t)
      : trainer_(t),
        recorder_(t.profile_, t.mesh_.world(), timed_communicators(t)),
        bytes_(t.mesh_),
        carried_in_(t.values_in_flight_sent()) {
    for (Communicator* channel : t.pipeline_.channels()) bytes_.count_as(Axis::pp, *channel);
    bytes_.count_as(Axis::pp, *t.embedding_group_);
    t.profile_ = nullptr;
    // The MoE blocks' aux loss: each sequence's counts 1/B of it, and its gradient is
    // scaled as the rest of the loss's (nothing happens in a dense model).
    ch07::MoeLog& log = *t.model_.moe_log();
    log.clear();
    log.weight = 1.0 / static_cast<double>(t.c_.batch);
    log.grad_scale = t.c_.scaler != ch06::Scaler::none ? t.scaler_.scale() : 1.0f;
  }
  /// The recorder of the step's spans.
  StepRecorder& recorder() { return recorder_; }
  /// The step's result, its loss and bytes and routing filled in from `ran`.
  StepResult finish(StepResult result, ch04::StageRun& ran) {
    recorder_.finish();
    Trainer& t = trainer_;
    result.bytes = bytes_.sent();
    // A step's bytes are what it started: ZeRO-1's all-gathers of this step's update,
    // still in flight, are its own; the last step's, which ended in this one, are not.
    result.bytes[Axis::dp] += t.values_in_flight_sent() - carried_in_;
    result.events = std::move(ran.events);
    // The batch's loss: the last stage's shares, once per replica (tp rank 0), summed.
    const bool counts = t.model_.last() && t.mesh_.coords().tp == 0;
    result.loss = t.mesh_.world().agree(counts ? ran.loss : 0.0, ReduceOp::sum);
    if (t.c_.model.experts == 0) return result;
    // The routing: every group once (its first cp rank logged it; tp rank 0 counts).
    const ch07::MoeLog& log = *t.model_.moe_log();
    ch07::RoutingStats counted;
    counted.wanted.assign(static_cast<std::size_t>(t.c_.model.experts), 0);
    counted.kept = counted.wanted;
    if (t.mesh_.coords().tp == 0) counted += log.stats;
    result.routing = ch07::combined(t.mesh_.world(), counted);
    result.dispatched = log.kept;
    return result;
  }

 private:
  /// The communicators whose calls the profile times: the mesh's but the pipeline's own
  /// (its waits are the bubble's), and the embedding group as pp.
  static std::vector<std::pair<Axis, Communicator*>> timed_communicators(Trainer& t) {
    std::vector<std::pair<Axis, Communicator*>> out;
    for (auto [axis, comm] : t.mesh_.communicators())
      if (comm != &t.mesh_.pp()) out.emplace_back(axis, comm);
    out.emplace_back(Axis::pp, t.embedding_group_.get());
    return out;
  }

  Trainer& trainer_;
  StepRecorder recorder_;
  ch08::AxisMeter bytes_;
  std::uint64_t carried_in_;  // the last step's all-gathers still in flight
};

StepResult Trainer::step(int step) {
  Meter meter(*this);
  replicas_->start_values();  // ZeRO-1's all-gathers of the last update, under the forward
  if (experts_) experts_->start_values();
  const std::vector<std::vector<std::int64_t>> microbatches = microbatches_of(step);  // 1.
  ch04::StageRun ran = run_pipeline(microbatches, meter);                             // 2.
  if (local_gradients_ && announced_.empty()) {  // not announced layer by layer: all now
    local_gradients_(model_.store().parameters());
    if (experts_) local_gradients_(model_.expert_store().parameters());
  }
  sync_gradients();  // 3.
  StepResult result;
  unscale_and_clip(result);  // 4.
  const auto start = StepRecorder::Clock::now();
  update(result);  // 5.
  meter.recorder().note("optimizer", "compute", start);
  return meter.finish(std::move(result), ran);
}

std::vector<std::vector<std::int64_t>> Trainer::microbatches_of(int step) const {
  const std::vector<std::int64_t> all = data_.batch(step, c_.batch, c_.model.seed);
  const shardlab::ShardRange mine =
      shard_range(c_.batch, c_.replicas(), c_.replica(mesh_.coords()));
  std::vector<std::vector<std::int64_t>> out;
  for (int j = 0; j < c_.microbatches; ++j) {
    const shardlab::ShardRange mb = shard_range(mine.length, c_.microbatches, j);
    const auto begin = all.begin() + mine.offset + mb.offset;
    out.emplace_back(begin, begin + mb.length);
  }
  return out;
}

ch04::StageRun Trainer::run_pipeline(const std::vector<std::vector<std::int64_t>>& microbatches,
                                     Meter& meter) {
  const std::vector<std::int64_t>& positions = model_.positions();  // of each sequence
  const double tokens = static_cast<double>(c_.batch * c_.model.context);
  StepRecorder& recorder = meter.recorder();
  ch04::Stage stage;
  for (int c = 0; c < model_.chunks(); ++c) stage.chunks.push_back(recorder.wrap(chunk_to_run(c)));
  stage.early_receives = c_.overlap[Axis::pp];
  stage.input = [&](int j) { return data_.ids(microbatches[j], 0, positions); };  // host ids
  stage.memory = c_.memory;
  const std::int64_t split = model_.sequence_parallel() ? c_.mesh.tp : 1;  // rows held: n / split
  const auto held = static_cast<std::int64_t>(positions.size());           // tokens of a sequence
  stage.boundary = [&](int j, int) {
    return ch04::Boundary{
        {static_cast<std::int64_t>(microbatches[j].size()) * held / split, c_.model.channels}};
  };
  stage.loss = [&](const Tensor& out, int j) {
    const auto start = StepRecorder::Clock::now();
    TiedHead& head = *model_.head();
    weights_ready(head.parameters());
    nn::Forward logits = head.forward(out);
    const VocabLoss loss = vocab_parallel_cross_entropy(mesh_.tp(), logits.out.to(Memory::host),
                                                        data_.ids(microbatches[j], 1, positions),
                                                        model_.vocab(), tokens);
    Tensor dlogits = vocab_parallel_cross_entropy_backward(loss).to(c_.memory);
    if (c_.scaler != ch06::Scaler::none) scale_in_place(dlogits, scaler_.scale());
    Tensor dx = head.backward(dlogits, logits.saved);
    // The head's gradients are final (the last microbatch's), but wte's where the
    // embedding on this rank adds to it still.
    if (!announced_.empty()) {
      std::vector<nn::Parameter*> done = head.parameters();
      if (model_.first()) std::erase(done, model_.tied());
      announce(done);
    }
    recorder.note("loss", "compute", start);
    return ch04::MicrobatchLoss{loss.value, std::move(dx)};
  };
  ch04::Hooks hooks;
  replicas_->accumulate(hooks);
  if (experts_) experts_->accumulate(hooks);
  model_.store().zero_grad();
  model_.expert_store().zero_grad();
  memory::Scope scope(memory::Category::activations);
  return pipeline_.run(schedule_, stage, hooks);
}

void Trainer::sync_gradients() {
  // The replicas' sums first, then those over tp and between the stages, as Megatron-LM's
  // finalize_model_grads orders them: the buckets can go while backward runs (--overlap
  // dp), before those. ZeRO-1's buckets whose gradients those sums change (wte's,
  // sequence parallelism's whole weights) are reduce-scattered after them (in reduced()),
  // the others as backward finished them.
  if (c_.zero == 0) {
    replicas_->reduce();
    if (experts_) experts_->reduce();
  }
  // Sequence parallel: a weight every tp rank holds whole has each rank's rows' gradient.
  if (model_.sequence_parallel()) sum_replicated_gradients();
  // The two copies of wte are one weight: each gets the sum of both gradients.
  if (c_.mesh.pp > 1 && model_.tied()) embedding_group_->allreduce(model_.tied()->grad);
}

void Trainer::unscale_and_clip(StepResult& result) {
  // ZeRO-1 without clipping or a scaler reduces inside its update (chapter 05's
  // zero1_step, or by buckets): no norm then.
  const bool scaled = c_.scaler != ch06::Scaler::none;
  result.loss_scale = scaler_.scale();
  if (c_.zero != 0 && c_.clip <= 0 && !scaled) return;
  ch08::ReplicaOptimizer::Reduced reduced = replicas_->reduced(), expert_reduced;
  if (experts_) expert_reduced = experts_->reduced();
  if (scaled)
    for (Tensor* grads : {&reduced.grads, &expert_reduced.grads}) {
      if (!grads->defined()) continue;
      Tensor unscaled(Shape{grads->size()}, shardlab::DType::f32, grads->memory());
      result.skipped = scaler_.unscale_and_check(mesh_.world(), *grads, unscaled) || result.skipped;
      grads->copy_from(unscaled);
    }
  if (!result.skipped)
    result.grad_norm = clip_gradients(reduced, experts_ ? &expert_reduced : nullptr);
  // The norm is every rank's (agreed): all skip together.
  if (c_.skip_nonfinite && !std::isfinite(result.grad_norm)) result.skipped = true;
}

void Trainer::update(const StepResult& result) {
  for (ch08::ReplicaOptimizer* o : {replicas_.get(), experts_.get()}) {
    if (!o) continue;
    if (result.skipped)
      o->skip();
    else
      o->update();
  }
  scaler_.update(result.skipped);
}

RoutingCounts ep_routing(Communicator& world, const MeshShape& mesh, const Coords& at,
                         const StepResult& result) {
  Communicator::Uncounted not_counted(world);
  std::vector<std::int64_t> mine;  // calls, then each call's counts
  for (const auto& call : result.dispatched) mine.insert(mine.end(), call.begin(), call.end());
  const std::vector<std::int64_t> sizes =
      world.gather_values(static_cast<std::int64_t>(mine.size()));
  std::vector<std::size_t> counts(sizes.begin(), sizes.end());
  std::size_t all = 0;
  for (std::size_t n : counts) all += n;
  Tensor every(Shape{static_cast<std::int64_t>(all)}, shardlab::DType::i64);
  world.allgatherv(Tensor::from_vector(mine), every, counts);
  const std::int64_t* v = every.data<std::int64_t>();
  std::vector<std::size_t> offset(counts.size(), 0);
  for (std::size_t r = 1; r < counts.size(); ++r) offset[r] = offset[r - 1] + counts[r - 1];
  const std::size_t E = result.dispatched.empty() ? 1 : result.dispatched.front().size();
  RoutingCounts out;
  for (int r : ch08::group_along(mesh, at, {ch08::Axis::ep})) {
    const auto q = static_cast<std::size_t>(r);
    auto& calls = out.emplace_back();
    for (std::size_t i = 0; i < counts[q]; i += E)
      calls.emplace_back(v + offset[q] + i, v + offset[q] + i + E);
  }
  return out;
}

void Trainer::sum_replicated_gradients() {
  // One allreduce over tp of them all, packed (Megatron-LM's sequence-parallel gradients):
  // the gradients of the weights every tp rank holds, each rank's its rows' part.
  std::vector<Tensor> grads;
  std::int64_t n = 0;
  const std::vector<nn::Parameter*> params = model_.store().parameters();
  for (std::size_t i = 0; i < params.size(); ++i)
    if (model_.pieces()[i].summed_over_tp()) {
      grads.push_back(params[i]->grad.flat());
      n += grads.back().size();
    }
  Tensor packed(Shape{n}, shardlab::DType::f32, c_.memory);
  std::int64_t at = 0;
  for (const Tensor& grad : grads) {  // pack
    packed.slice(at, grad.size()).copy_from(grad);
    at += grad.size();
  }
  mesh_.tp().allreduce(packed);
  at = 0;
  for (Tensor& grad : grads) {  // unpack
    grad.copy_from(packed.slice(at, grad.size()));
    at += grad.size();
  }
}

double Trainer::clip_gradients(ch08::ReplicaOptimizer::Reduced& reduced,
                               ch08::ReplicaOptimizer::Reduced* experts) {
  // Each parameter once: one replica's gradients (or, under ZeRO-1, each replica's own
  // range of them), tp rank 0's copy of what every tp rank holds, and not the head's copy
  // of wte (the pieces say which); the experts' likewise over their replicas.
  auto squares_of = [](const ch08::ReplicaOptimizer::Reduced& r, Communicator& replicas,
                       nn::ParameterStore& store, const std::vector<Piece>& pieces) {
    const Tensor grads = r.grads.to(Memory::host);  // a copy under --device cuda
    double squares = 0;
    if (r.every_replica && replicas.rank() != 0) return squares;
    const std::vector<nn::Parameter*> params = store.parameters();
    std::int64_t at = 0;  // where the range starts in grads
    for (const shardlab::ShardRange& range : r.ranges) {
      const std::int64_t first = range.offset, end = first + range.length;
      for (std::size_t i = 0; i < params.size(); ++i) {
        const std::int64_t from = std::max(first, params[i]->offset),
                           to = std::min(end, params[i]->offset + params[i]->value.size());
        if (!pieces[i].counted || from >= to) continue;
        squares += shardlab::sum_of_squares(grads.slice(at + from - first, to - from));
      }
      at += range.length;
    }
    return squares;
  };
  double squares = squares_of(reduced, mesh_.replicas(), model_.store(), model_.pieces());
  if (experts)
    squares += squares_of(*experts, mesh_.expert_replicas(), model_.expert_store(),
                          model_.expert_pieces());
  const double norm = std::sqrt(mesh_.world().agree(squares, ReduceOp::sum));
  if (c_.clip > 0) {
    const float coef = static_cast<float>(c_.clip / (norm + 1e-6));
    if (coef < 1.0f) {
      scale_in_place(reduced.grads, coef);
      if (experts) scale_in_place(experts->grads, coef);
    }
  }
  return norm;
}

Tensor Trainer::forward_only(const Tensor& ids) {
  replicas_->wait_values();  // ZeRO-1's all-gathers of the last update
  if (experts_) experts_->wait_values();
  // Virtual stage k = c p + s runs on stage s as its chunk c; each passes its output to
  // the next (on this stage itself when p = 1).
  Communicator& pp = mesh_.pp();
  const int s = pp.rank(), p = pp.size(), last = p * model_.chunks() - 1;
  const std::int64_t n = ids.size() / (model_.sequence_parallel() ? c_.mesh.tp : 1),
                     C = c_.model.channels;  // the rows this rank holds between stages
  constexpr int kTag = 9000;                 // apart from the pipeline runtime's own channels
  Tensor x = ids;                            // this rank's tokens of each sequence
  for (int k = s; k <= last; k += p) {
    if (k > 0 && p > 1) {
      x = Tensor(Shape{n, C}, shardlab::DType::f32, c_.memory);
      pp.recv(x, (k - 1) % p, kTag + k);
    }
    x = model_.chunk(k / p).forward(x).out;
    if (k < last && p > 1) pp.send(x, (k + 1) % p, kTag + k + 1);
  }
  return model_.last() ? x : Tensor();
}

double Trainer::evaluate(const std::vector<std::int64_t>& starts) {
  const Coords& at = mesh_.coords();
  const shardlab::ShardRange mine =
      shard_range(static_cast<std::int64_t>(starts.size()), c_.replicas(), c_.replica(at));
  const std::vector<std::int64_t> part(starts.begin() + mine.offset,
                                       starts.begin() + mine.offset + mine.length);
  const std::vector<std::int64_t>& positions = model_.positions();
  double loss = 0;
  // Every replica runs the forward, one without sequences too: a MoE block's all-to-alls
  // need every ep rank.
  const Tensor out = forward_only(data_.ids(part, 0, positions));
  if (!part.empty()) {
    if (model_.last()) {
      const Tensor logits = model_.head()->forward(out).out.to(Memory::host);
      loss = vocab_parallel_cross_entropy(
                 mesh_.tp(), logits, data_.ids(part, 1, positions), model_.vocab(),
                 static_cast<double>(starts.size() * static_cast<std::size_t>(c_.model.context)))
                 .value;
    }
  }
  return mesh_.world().agree(model_.last() && at.tp == 0 ? loss : 0.0, ReduceOp::sum);
}

double run_bytes(const TrainConfig& c, bool threads) {
  const GptShape& g = c.model;
  const double C = static_cast<double>(g.channels), T = static_cast<double>(g.context),
               B = static_cast<double>(c.batch), L = g.layers, H = static_cast<double>(g.heads);
  // Weights, gradients and Adam's m and v (4 floats a parameter); the activations a
  // block keeps for its backward (some 16 C a token, and the attention's T x T per
  // head), the logits and their softmax.
  const double states = 4.0 * 4 * static_cast<double>(parameter_count(g));
  const double activations =
      4.0 * B * T * (L * (16 * C + 2 * H * T) + 3.0 * static_cast<double>(g.vocab));
  // One device's run; the mesh's ranks together hold about as much (each its share of
  // the batch, the layers and the heads), after the reference has freed its own. Measured
  // (peak RSS over this): 1.33 GB over 1.43 (B 64, T 256, one rank), 0.18 over 0.09 at the
  // defaults, where the program itself is most of it.
  const double one = 1.25 * (states + activations);
  return threads ? one + states : one;
}

std::int64_t parameter_count(const GptShape& s, int experts_per_token) {
  const std::int64_t C = s.channels, mlp = 8 * C * C + 5 * C;  // c_fc and c_proj, biases
  std::int64_t moe_blocks = 0;
  for (int b = 0; b < s.layers; ++b) moe_blocks += s.moe(b);
  // A MoE block: its router, and `experts_per_token` MLPs where the dense block has one.
  const std::int64_t experts = experts_per_token < 0 ? s.experts : experts_per_token;
  return s.vocab * C + s.context * C + s.layers * (12 * C * C + 13 * C) + 2 * C +
         moe_blocks * (C * s.experts + (experts - 1) * mlp);
}

std::string describe_experts(const GptShape& s) {
  auto n = [](auto v) { return std::to_string(v); };
  return n(s.experts) + " experts, top-" + n(s.top_k) +
         (s.moe_every == 1   ? " in every block"
          : s.moe_every == 2 ? " in every other block"
                             : " in one block of every " + n(s.moe_every)) +
         ", capacity factor " + shardlab::format_number(s.capacity_factor) + ", aux " +
         shardlab::format_number(s.aux_alpha);
}

std::string experts_flags(const GptShape& s) {
  return "--experts " + std::to_string(s.experts) + " --top-k " + std::to_string(s.top_k) +
         " --moe-every " + std::to_string(s.moe_every) + " --capacity-factor " +
         shardlab::format_number(s.capacity_factor) + " --aux-alpha " +
         shardlab::format_number(s.aux_alpha);
}

std::string describe(const TrainConfig& c, std::string_view backend, bool with_mesh) {
  const GptShape& s = c.model;
  const MeshShape& m = c.mesh;
  auto n = [](auto v) { return std::to_string(v); };
  return "GPT (L " + n(s.layers) + ", C " + n(s.channels) + ", H " + n(s.heads) + ", T " +
         n(s.context) + ", V " + n(s.vocab) + "; " +
         shardlab::format_number(static_cast<double>(parameter_count(s)) / 1e6) + "M parameters" +
         (s.experts > 0 ? ", " +
                              shardlab::format_number(
                                  static_cast<double>(parameter_count(s, s.top_k)) / 1e6) +
                              "M a token; " + describe_experts(s)
                        : "") +
         ")" + (with_mesh ? " on " + ch08::mesh_name(m) : std::string()) + " (" +
         std::string(backend) + "), " + (m.cp > 1 && c.context ? c.context->name() + ", " : "") +
         c.schedule + ", " + n(c.microbatches) + " microbatches; batch " + n(c.batch) + " x " +
         n(s.context) + " bytes, " + (c.zero ? "ZeRO-1" : "Adam") + " lr " +
         shardlab::format_number(c.adam.lr) +
         (c.clip > 0 ? ", clip " + shardlab::format_number(c.clip) : "") +
         (c.sequence_parallel ? ", sequence parallel" : "") +
         (c.overlap != overlap_of("all") ? ", overlapping " + overlap_name(c.overlap) : "") +
         (c.precision != shardlab::DType::f32
              ? ", " + std::string(precision_name(c.precision)) + " products (autocast)" +
                    (c.scaler == ch06::Scaler::dynamic ? ", dynamic loss scale"
                     : c.scaler == ch06::Scaler::fixed ? ", static loss scale"
                                                       : "")
              : "");
}

namespace {

/// What rank `rank` of `ranks` sends in a ring allreduce of `elements` floats
/// (shardlab::collective_traffic, exactly).
std::uint64_t allreduce_bytes(std::int64_t elements, int rank, int ranks) {
  return shardlab::collective_traffic(shardlab::Op::allreduce, static_cast<std::size_t>(elements),
                                      4, rank, ranks)
      .sent;
}

/// The MoE blocks among rank `at`'s blocks.
std::int64_t moe_blocks_of(const TrainConfig& c, const Coords& at) {
  std::int64_t n = 0;
  for (const ChunkBlocks& chunk : chunks_of(c.model, c.mesh, at, c.chunks))
    for (int b = chunk.first; b < chunk.first + chunk.count; ++b) n += c.model.moe(b);
  return n;
}

/// tp's bytes for one microbatch of n tokens. Its collectives of n x C elements, in halves of
/// an allreduce (an all-gather or a reduce-scatter moves half of one): the attention's f and
/// g, forward and backward (2 allreduces; full recompute's second forward 1 more), and a
/// dense MLP's the same; sequence parallel, each of the two an all-gather and a
/// reduce-scatter forward and backward plus the column-parallel input's second gather (5
/// halves; full recompute 2 more); the embedding's and the head's one allreduce each. A MoE
/// MLP has no f and g at its edges (its experts have theirs: expert_bytes); sequence
/// parallel, its rows are gathered before it and dL/dy's after (2 halves; full recompute 1
/// more). The last stage's cross-entropy: 3 allreduces of n numbers.
std::uint64_t tp_bytes(const TrainConfig& c, const Coords& at, std::int64_t n) {
  const MeshShape& m = c.mesh;
  const bool full = c.recompute == Recompute::full, split = c.sequence_parallel && m.tp > 1;
  const bool first = at.pp == 0, last = at.pp == m.pp - 1;
  const std::int64_t blocks = c.model.layers / m.pp, moe = moe_blocks_of(c, at);
  const std::int64_t per_block = split ? (full ? 7 : 5) : 2 * (full ? 3 : 2);
  const std::int64_t halves =
      per_block * (2 * blocks - moe) + (split ? (full ? 3 : 2) * moe : 0) + 2 * (first + last);
  std::uint64_t out =
      static_cast<std::uint64_t>(halves) * allreduce_bytes(n * c.model.channels, at.tp, m.tp) / 2;
  if (last) out += 3 * allreduce_bytes(n, at.tp, m.tp);
  return out;
}

/// pp's bytes for one microbatch of n tokens: its n x C activation to the next virtual stage
/// and their gradient to the one before, from each chunk (n/t rows under sequence
/// parallelism), to other stages only.
std::uint64_t pp_bytes(const TrainConfig& c, const Coords& at, std::int64_t n) {
  const MeshShape& m = c.mesh;
  if (m.pp == 1) return 0;
  const std::int64_t rows = n / (c.sequence_parallel && m.tp > 1 ? m.tp : 1);
  std::uint64_t out = 0;
  for (const ChunkBlocks& chunk : chunks_of(c.model, m, at, c.chunks))
    out +=
        static_cast<std::uint64_t>((!chunk.embeds + !chunk.is_last) * rows * c.model.channels * 4);
  return out;
}

/// cp's bytes for one microbatch of `sequences` sequences: every block's core, a forward and
/// a backward of the ring's bytes (recomputation, selective or full, runs its forward again);
/// each MoE block's gather of the router's probabilities of its n tokens, (cp - 1) n E floats
/// a forward.
std::uint64_t cp_bytes(const TrainConfig& c, const Coords& at, std::int64_t sequences) {
  const MeshShape& m = c.mesh;
  if (m.cp == 1) return 0;
  const GptShape& g = c.model;
  const std::int64_t heads = g.heads / m.tp, head_dim = g.channels / g.heads;
  const std::int64_t n = sequences * (g.context / m.cp);
  const int forwards = c.recompute == Recompute::none ? 1 : 2;
  const int moe_forwards = c.recompute == Recompute::full ? 2 : 1;
  return static_cast<std::uint64_t>(g.layers / m.pp) *
             (forwards * c.context->forward_bytes(m.cp, g.context, sequences, heads, head_dim) +
              c.context->backward_bytes(m.cp, g.context, sequences, heads, head_dim)) +
         static_cast<std::uint64_t>(moe_blocks_of(c, at) * moe_forwards * (m.cp - 1) * n *
                                    g.experts * 4);
}

/// ep's bytes and the experts' tp bytes, from `routing` (every ep rank's kept choices per
/// expert, per MoE backward): each call's all-to-alls forward, the counts ((ep - 1) E/ep of
/// 8 bytes) and the rows to the experts' ranks and back (the kept choices whose expert is on
/// another rank, and those of the others for this rank's experts, C floats each); backward
/// the rows again both ways; full recompute's second forward once more. Each local expert's
/// g (forward, again under full recompute) and f (backward) are tp allreduces of its rows.
void add_expert_bytes(const TrainConfig& c, const Coords& at, const RoutingCounts& routing,
                      ch08::AxisBytes& out) {
  const GptShape& g = c.model;
  const MeshShape& m = c.mesh;
  const int per_rank = g.experts / m.ep, me = at.ep,
            moe_forwards = c.recompute == Recompute::full ? 2 : 1;
  const auto C = static_cast<std::uint64_t>(g.channels);
  auto rows_of = [&](int q, std::size_t call, int e) {
    return routing[static_cast<std::size_t>(q)][call][static_cast<std::size_t>(e)];
  };
  for (std::size_t call = 0; call < routing[static_cast<std::size_t>(me)].size(); ++call) {
    std::uint64_t sent = 0, received = 0;
    for (int q = 0; q < m.ep; ++q)
      for (int e = 0; e < g.experts; ++e) {
        const bool here = e / per_rank == me;
        if (q == me && !here) sent += static_cast<std::uint64_t>(rows_of(q, call, e));
        if (q != me && here) received += static_cast<std::uint64_t>(rows_of(q, call, e));
      }
    const std::uint64_t counts = static_cast<std::uint64_t>((m.ep - 1) * per_rank) * 8;
    out[Axis::ep] +=
        moe_forwards * (counts + (sent + received) * C * 4) + (sent + received) * C * 4;
    for (int e = me * per_rank; e < (me + 1) * per_rank; ++e) {
      std::int64_t rows = 0;
      for (int q = 0; q < m.ep; ++q) rows += rows_of(q, call, e);
      out[Axis::tp] += static_cast<std::uint64_t>(moe_forwards + 1) *
                       allreduce_bytes(rows * g.channels, at.tp, m.tp);
    }
  }
}

/// dp's bytes: one allreduce of the rank's dense parameters over the dp x ep x cp replicas
/// (this rank at (dp_i ep + ep_i) cp + cp_i), and of its experts' over the dp x cp expert
/// replicas (at dp_i cp + cp_i).
std::uint64_t dp_bytes(const TrainConfig& c, const Coords& at, const DpBuckets& buckets) {
  const MeshShape& m = c.mesh;
  std::int64_t params = 0, expert_params = 0;
  for (const Piece& p : pieces_of(c.model, m, at, c.chunks)) params += p.size();
  for (const Piece& p : expert_pieces_of(c.model, m, at, c.chunks)) expert_params += p.size();
  // Bucket by bucket (the ring cuts each into its own N parts).
  auto by_buckets = [](const std::vector<std::int64_t>& sizes, std::int64_t whole, int rank,
                       int ranks) {
    std::uint64_t out = 0;
    for (std::int64_t n : sizes.empty() ? std::vector<std::int64_t>{whole} : sizes)
      out += allreduce_bytes(n, rank, ranks);
    return out;
  };
  std::uint64_t out =
      by_buckets(buckets.dense, params, c.replica(at) * m.cp + at.cp, c.replicas() * m.cp);
  if (c.model.experts > 0)
    out += by_buckets(buckets.experts, expert_params, at.dp * m.cp + at.cp, m.dp * m.cp);
  return out;
}

}  // namespace

ch08::AxisBytes formula_bytes(const TrainConfig& c, const Coords& at, const RoutingCounts& routing,
                              const DpBuckets& buckets) {
  const MeshShape& m = c.mesh;
  const shardlab::ShardRange mine = shard_range(c.batch, c.replicas(), c.replica(at));
  const std::int64_t tokens = c.model.context / m.cp;  // of each sequence, on this rank
  ch08::AxisBytes out;
  for (int j = 0; j < c.microbatches; ++j) {
    const std::int64_t sequences = shard_range(mine.length, c.microbatches, j).length;
    out[Axis::tp] += tp_bytes(c, at, sequences * tokens);
    out[Axis::pp] += pp_bytes(c, at, sequences * tokens);
    out[Axis::cp] += cp_bytes(c, at, sequences);
  }
  if (c.model.experts > 0 && !routing.empty()) add_expert_bytes(c, at, routing, out);
  // Sequence parallel: the rows' parts of the weights every tp rank holds whole, summed.
  if (c.sequence_parallel && m.tp > 1) {
    std::int64_t whole = 0;
    for (const Piece& p : pieces_of(c.model, m, at, c.chunks))
      if (p.summed_over_tp()) whole += p.size();
    out[Axis::tp] += allreduce_bytes(whole, at.tp, m.tp);
  }
  out[Axis::dp] = dp_bytes(c, at, buckets);
  // wte's gradient, summed between the first and the last stage.
  if (m.pp > 1 && (at.pp == 0 || at.pp == m.pp - 1))
    out[Axis::pp] += allreduce_bytes(
        shard_range(c.model.vocab, m.tp, at.tp).length * c.model.channels, at.pp == m.pp - 1, 2);
  return out;
}

}  // namespace ch09

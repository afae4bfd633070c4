// Chapter 09 against one device (references.hpp).
#include "references.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <memory>

#include "mesh_checks.hpp"
#include "shardlab/format.hpp"

namespace ch09 {

using shardlab::Communicator;
using shardlab::Context;
using shardlab::Table;
using shardlab::Tensor;

double relative(double a, double b) { return std::abs(a - b) / std::max(1.0, std::abs(b)); }

namespace {

/// One device's training, written here apart from the mesh's Trainer and from the
/// exercise: GptModel on a 1 x 1 x 1 mesh with the library's attention (attention_block,
/// not the exercise's parallel_attention), the loss the library's nn::cross_entropy (each
/// microbatch its share of the batch's mean), the loss scaler of chapter 06, the gradients
/// clipped to their global norm, the library's Adam; nothing recomputed.
class OneDevice {
 public:
  OneDevice(Communicator& self, TrainConfig c, int microbatches, const Corpus& data)
      : c_(with_one_device(c, microbatches)),
        data_(data),
        mesh_(self, c_.mesh),
        model_(mesh_, c_.model, options_of(c_)),
        scaler_(c_.scaler, c_.scaler_config) {
    for (nn::ParameterStore* store : stores())
      adam_.push_back(std::make_unique<nn::Adam>(store->size(), c_.adam, c_.memory));
  }

  /// Trains step `step` (which batch), as Trainer::step defines one.
  StepResult step(int step) {
    const std::int64_t B = c_.batch;
    const std::vector<std::int64_t> all = data_.batch(step, B, c_.model.seed);
    const float scale = scaler_.scale();
    ch07::MoeLog& log = *model_.moe_log();
    log.clear();
    log.weight = 1.0 / static_cast<double>(B);
    log.grad_scale = scale;
    for (nn::ParameterStore* store : stores()) store->zero_grad();
    StepResult result;
    for (int j = 0; j < c_.microbatches; ++j) {
      const shardlab::ShardRange rows = shardlab::shard_range(B, c_.microbatches, j);
      const std::vector<std::int64_t> starts(all.begin() + rows.offset,
                                             all.begin() + rows.offset + rows.length);
      const double share = static_cast<double>(rows.length) / static_cast<double>(B);
      const nn::Loss loss = forward(starts);
      result.loss += loss.value * share;
      Tensor dlogits = nn::cross_entropy_backward(loss.saved).to(c_.memory);
      scale_in_place(dlogits, static_cast<float>(share) * scale);
      model_.chunk().backward(model_.head()->backward(dlogits, logits_.saved), body_.saved);
    }
    result.loss_scale = scale;
    result.skipped = unscale();
    if (!result.skipped) {
      result.grad_norm = clip();
      for (std::size_t i = 0; i < adam_.size(); ++i)
        adam_[i]->step(stores()[i]->values(), stores()[i]->grads());
    }
    scaler_.update(result.skipped);
    if (c_.model.experts > 0) {
      result.routing.wanted.assign(static_cast<std::size_t>(c_.model.experts), 0);
      result.routing.kept = result.routing.wanted;
      result.routing += log.stats;
    }
    return result;
  }

  /// The mean loss over `starts`' sequences, forward only.
  double evaluate(const std::vector<std::int64_t>& starts) { return forward(starts).value; }

 private:
  /// The model's options: the library's attention, not the exercise's (at tp 1).
  static ModelOptions options_of(const TrainConfig& c) {
    ModelOptions o = c.model_options();
    o.library_attention = true;
    return o;
  }
  static TrainConfig with_one_device(TrainConfig c, int microbatches) {
    c.mesh = {.pp = 1, .dp = 1, .tp = 1};
    c.microbatches = microbatches;
    c.zero = 0;
    c.schedule = "1f1b";
    c.chunks = 1;
    c.recompute = Recompute::none;
    c.sequence_parallel = false;
    c.context = nullptr;
    return c;
  }
  std::vector<nn::ParameterStore*> stores() {
    std::vector<nn::ParameterStore*> out{&model_.store()};
    if (c_.model.experts > 0) out.push_back(&model_.expert_store());
    return out;
  }
  /// The model on `starts`' sequences and the library's cross-entropy of its logits (the
  /// mean over their tokens); what the backward needs in body_ and logits_.
  nn::Loss forward(const std::vector<std::int64_t>& starts) {
    body_ = model_.chunk().forward(data_.ids(starts, 0));
    logits_ = model_.head()->forward(body_.out);
    return nn::cross_entropy(logits_.out.to(Memory::host), data_.ids(starts, 1));
  }
  /// The summed gradients over the loss scale, in place; true when one is inf or NaN.
  bool unscale() {
    if (c_.scaler == ch06::Scaler::none) return false;
    bool found = false;
    for (nn::ParameterStore* store : stores()) {
      Tensor& grads = store->grads();
      Tensor unscaled(shardlab::Shape{grads.size()}, shardlab::DType::f32, grads.memory());
      found = scaler_.unscale_and_check(mesh_.world(), grads, unscaled) || found;
      grads.copy_from(unscaled);
    }
    return found;
  }
  /// The global norm of the gradients, and the gradients scaled to c.clip when above it
  /// (PyTorch's clip_grad_norm_).
  double clip() {
    double squares = 0;
    for (nn::ParameterStore* store : stores())
      for (float g : store->grads().to(Memory::host).span()) squares += static_cast<double>(g) * g;
    const double norm = std::sqrt(squares);
    const auto coef = static_cast<float>(c_.clip / (norm + 1e-6));
    if (c_.clip > 0 && coef < 1.0f)
      for (nn::ParameterStore* store : stores()) scale_in_place(store->grads(), coef);
    return norm;
  }

  TrainConfig c_;
  const Corpus& data_;
  Mesh mesh_;
  GptModel model_;
  ch06::LossScaler scaler_;
  std::vector<std::unique_ptr<nn::Adam>> adam_;
  nn::Forward body_, logits_;
};

Curve train_one_device(Communicator& self, const TrainConfig& c, int microbatches,
                       const Corpus& data, int steps) {
  OneDevice one(self, c, microbatches, data);
  Curve out;
  for (int t = 0; t < steps; ++t) out.add(one.step(t));
  out.validation = one.evaluate(data.validation(16));
  return out;
}

}  // namespace

References train_references(Context& ctx, const TrainConfig& c, const Corpus& data, int steps) {
  auto self = ctx.comm().split(ctx.rank(), 0);
  Communicator::Patience wait(
      ctx.comm(),
      std::chrono::milliseconds(static_cast<long>(ctx.options().timeout_s * 1000 * (steps + 2))));
  Communicator::Uncounted not_counted(ctx.comm());
  const int pieces = c.mesh.dp * c.microbatches, maker = ctx.size() > 1 ? 1 : 0;
  References ref;
  if (ctx.rank() == 0) ref.whole = train_one_device(*self, c, 1, data, steps);
  if (ctx.rank() == maker) ref.pieces = train_one_device(*self, c, pieces, data, steps);
  // The pieces' curve to rank 0, every double's bits as they are.
  const auto n = static_cast<std::size_t>(steps);
  Tensor bits(shardlab::Shape{3 * steps + 1}, shardlab::DType::i64);
  auto* b = bits.data<std::int64_t>();
  if (maker == 1) {
    if (ctx.rank() == 1) {
      for (std::size_t t = 0; t < n; ++t) {
        b[t] = std::bit_cast<std::int64_t>(ref.pieces.loss[t]);
        b[n + t] = std::bit_cast<std::int64_t>(ref.pieces.aux[t]);
        b[2 * n + t] = std::bit_cast<std::int64_t>(ref.pieces.dropped[t]);
      }
      b[3 * n] = std::bit_cast<std::int64_t>(ref.pieces.validation);
      ctx.comm().send(bits, 0, 1);
    } else if (ctx.rank() == 0) {
      ctx.comm().recv(bits, 1, 1);
      for (std::size_t t = 0; t < n; ++t) {
        ref.pieces.loss.push_back(std::bit_cast<double>(b[t]));
        ref.pieces.aux.push_back(std::bit_cast<double>(b[n + t]));
        ref.pieces.dropped.push_back(std::bit_cast<double>(b[2 * n + t]));
      }
      ref.pieces.validation = std::bit_cast<double>(b[3 * n]);
    }
  }
  ctx.comm().barrier();
  return ref;
}

namespace {
std::vector<std::string> curve_columns(bool scaled, bool experts) {
  std::vector<std::string> out{"step", "one_device", "mesh", "diff", "order_alone", "grad_norm"};
  if (experts) out.insert(out.end(), {"aux_loss", "dropped", "dropped_one_device"});
  if (scaled) out.insert(out.end(), {"loss_scale", "skipped"});
  return out;
}
}  // namespace

CurveTable::CurveTable(const TrainConfig& c, const References* ref)
    : ref_(ref),
      scaler_(c.scaler),
      scaled_(c.scaler != ch06::Scaler::none),
      experts_(c.model.experts > 0),
      table_(curve_columns(scaled_, experts_)) {}

void CurveTable::add(std::size_t index, int step, const StepResult& result, bool shown) {
  if (steps_++ == 0) first_scale_ = result.loss_scale;
  skipped_ += result.skipped;
  mesh_.add(result);
  if (!shown) return;
  auto ref_cell = [&](auto f) { return ref_ ? shardlab::Cell(f()) : shardlab::Cell(""); };
  std::vector<shardlab::Cell> row{
      step,
      ref_cell([&] { return ref_->whole.loss[index]; }),
      result.loss,
      ref_cell([&] { return relative(result.loss, ref_->whole.loss[index]); }),
      ref_cell([&] { return relative(ref_->pieces.loss[index], ref_->whole.loss[index]); }),
      result.grad_norm};
  if (experts_)
    row.insert(row.end(),
               {shardlab::Cell(result.routing.aux_loss), shardlab::Cell(result.routing.dropped),
                ref_cell([&] { return ref_->whole.dropped[index]; })});
  if (scaled_) row.insert(row.end(), {shardlab::Cell(result.loss_scale), shardlab::Cell(skipped_)});
  table_.add(row);
}

std::string CurveTable::dead_run() const {
  return scaled_ ? ch06::no_step_taken(scaler_, skipped_, steps_, first_scale_) : "";
}

namespace {

/// The larger of m and d, NaN when either is.
void most(double& m, double d) { m = std::isnan(d) || std::isnan(m) ? NAN : std::max(m, d); }

/// A per-step quantity on the mesh and on one device again in pieces, each against one
/// device (rank 0's: it holds the curves): at its worst step, or (`first_only`) at step 1.
ch08::Agreement agreement(const Context& ctx, const References& ref, const Curve& mesh,
                          std::vector<double> Curve::*of, std::string what, bool first_only) {
  ch08::Agreement row{.what = std::move(what)};
  if (ctx.rank() != 0) return row;
  const std::size_t steps = first_only ? 1 : (mesh.*of).size();
  for (std::size_t t = 0; t < steps; ++t) {
    most(row.diff, relative((mesh.*of)[t], (ref.whole.*of)[t]));
    most(row.order_alone, relative((ref.pieces.*of)[t], (ref.whole.*of)[t]));
  }
  if (first_only) row.one_device = (ref.whole.*of)[0], row.mesh = (mesh.*of)[0];
  return row;
}

}  // namespace

void compare_with_one_device(Context& ctx, const References& ref, const Curve& mesh,
                             double validation) {
  std::vector<ch08::Agreement> rows{
      agreement(ctx, ref, mesh, &Curve::loss, "the training loss, worst step", false),
      {.what = "the validation loss", .one_device = ref.whole.validation, .mesh = validation}};
  if (ctx.rank() == 0) {
    rows[1].diff = relative(validation, ref.whole.validation);
    rows[1].order_alone = relative(ref.pieces.validation, ref.whole.validation);
  }
  // With experts, the routing of the first step: from the same weights, each sequence
  // routed on its own, the mesh drops exactly the choices one device drops, and its aux
  // loss is one device's but for the order of its sums. (Later steps route from weights
  // that differ by what the order of additions does, and the routing, a choice, turns
  // those bits into whole tokens sent elsewhere: the curve's table shows both.)
  const bool experts = ctx.comm().agree(mesh.aux.empty() || mesh.aux.front() == 0 ? 0.0 : 1.0,
                                        shardlab::ReduceOp::max) > 0;
  if (experts) {
    rows.push_back(agreement(ctx, ref, mesh, &Curve::aux, "the aux loss, first step", true));
    rows.back().own_least = kTolerance;
    rows.push_back(
        agreement(ctx, ref, mesh, &Curve::dropped, "the dropped choices, first step", true));
    rows.back().own_least = 0.0;
  }
  const double times = experts ? kOrderExperts : kOrder;
  ch08::report_vs_one_device(
      ctx, rows, {.least = kTolerance, .times = times, .worst_of_all = true},
      "\nthe mesh against one device, relative; order alone: one device with the batch in the "
      "mesh's pieces (the worst, step or validation, x " +
          shardlab::format_number(times) + " is the tolerance; at least " +
          shardlab::format_number(kTolerance) + ")" +
          (experts ? "; the first step's routing is held to its own order alone, the "
                     "dropped choices exactly"
                   : ""));
}

void check_training(Context& ctx, const CurveTable& curve, std::int64_t vocab, bool from_scratch,
                    double validation) {
  const std::vector<double>& loss = curve.mesh().loss;
  if (loss.empty()) return;
  const double uniform = std::log(static_cast<double>(vocab));
  const std::string ln =
      "ln " + std::to_string(vocab) + " = " + shardlab::format_number(uniform, 3);
  // Guessing uniformly costs ln V nats a byte: a run that ends a nat above it has
  // diverged, whatever the reference did. Once that or a dead run is said, nothing more.
  const double last = loss.back();
  if (!ctx.verify(std::isfinite(last) && last < uniform + 1,
                  "the training diverged: the last step's loss is " +
                      shardlab::format_number(last) + " (guessing uniformly gives " +
                      shardlab::format_number(uniform, 3) + "; try a lower --lr)") ||
      !ctx.verify(curve.dead_run().empty(), curve.dead_run()))
    return;
  // A cross-entropy is -log of a probability: never below 0, in float too (the row's
  // maximum is one of its terms, so the log of the sum is at least 0).
  for (std::size_t t = 0; t < loss.size(); ++t)
    if (!ctx.verify(loss[t] >= 0, "step " + std::to_string(t + 1) + "'s loss is " +
                                      shardlab::format_number(loss[t]) +
                                      ": a cross-entropy is -log of a probability, never "
                                      "negative (vocab_parallel_cross_entropy)"))
      return;
  ctx.verify(validation >= 0, "the validation loss is " + shardlab::format_number(validation) +
                                  ": a cross-entropy is never negative");
  if (!from_scratch) return;
  ctx.verify(std::abs(loss[0] - uniform) <= kFirstStepSpread,
             "the first step's loss is " + shardlab::format_number(loss[0]) + ", not within " +
                 shardlab::format_number(kFirstStepSpread) + " of " + ln +
                 ": fresh weights give every byte about the same logit");
  if (static_cast<int>(loss.size()) < kLearnSteps) return;
  const double best =
      *std::min_element(loss.begin() + static_cast<std::ptrdiff_t>(loss.size() / 2), loss.end());
  ctx.verify(best < uniform,
             "in the last " + std::to_string(loss.size() - loss.size() / 2) + " of " +
                 std::to_string(loss.size()) + " steps the loss never fell below " + ln +
                 ", a uniform guess's (step 1: " + shardlab::format_number(loss[0]) + ", step " +
                 std::to_string(loss.size()) + ": " + shardlab::format_number(loss.back()) +
                 "): the model did not learn from its targets (the loss's gradient, or too low "
                 "a --lr)");
}

}  // namespace ch09

// Chapter 09 against one device (references.hpp).
#include "references.hpp"

#include <algorithm>
#include <bit>
#include <cmath>

#include "mesh_checks.hpp"
#include "shardlab/format.hpp"

namespace ch09 {

using shardlab::Communicator;
using shardlab::Context;
using shardlab::Table;
using shardlab::Tensor;

double relative(double a, double b) { return std::abs(a - b) / std::max(1.0, std::abs(b)); }

namespace {

Curve train_one_device(Communicator& self, TrainConfig c, int microbatches, const Corpus& data,
                       int steps) {
  c.mesh = {1, 1, 1};
  c.microbatches = microbatches;
  c.zero = 0;
  c.schedule = "1f1b";
  c.chunks = 1;
  Mesh mesh(self, c.mesh);
  GptModel model(mesh, c.model, c.model_options());
  Trainer trainer(mesh, model, c, data);
  Curve out;
  for (int t = 0; t < steps; ++t) out.loss.push_back(trainer.step(t).loss);
  out.validation = trainer.evaluate(data.validation(16));
  return out;
}

}  // namespace

References train_references(Context& ctx, const TrainConfig& c, const Corpus& data, int steps) {
  auto self = ctx.comm().split(ctx.rank(), 0);
  Communicator::Patience wait(
      ctx.comm(),
      std::chrono::milliseconds(static_cast<long>(ctx.options().timeout_s * 1000 * (steps + 2))));
  Communicator::Uncounted quiet(ctx.comm());
  const int pieces = c.mesh.dp * c.microbatches, maker = ctx.size() > 1 ? 1 : 0;
  References ref;
  if (ctx.rank() == 0) ref.whole = train_one_device(*self, c, 1, data, steps);
  if (ctx.rank() == maker) ref.pieces = train_one_device(*self, c, pieces, data, steps);
  // The pieces' curve to rank 0, every double's bits as they are.
  Tensor bits(shardlab::Shape{steps + 1}, shardlab::DType::i64);
  auto* b = bits.data<std::int64_t>();
  if (maker == 1) {
    if (ctx.rank() == 1) {
      for (int t = 0; t < steps; ++t)
        b[t] = std::bit_cast<std::int64_t>(ref.pieces.loss[static_cast<std::size_t>(t)]);
      b[steps] = std::bit_cast<std::int64_t>(ref.pieces.validation);
      ctx.comm().send(bits, 0, 1);
    } else if (ctx.rank() == 0) {
      ctx.comm().recv(bits, 1, 1);
      for (int t = 0; t < steps; ++t) ref.pieces.loss.push_back(std::bit_cast<double>(b[t]));
      ref.pieces.validation = std::bit_cast<double>(b[steps]);
    }
  }
  ctx.comm().barrier();
  return ref;
}

namespace {
std::vector<std::string> curve_columns(bool scaled) {
  std::vector<std::string> out{"step", "one_device", "mesh", "diff", "order_alone", "grad_norm"};
  if (scaled) out.insert(out.end(), {"loss_scale", "skipped"});
  return out;
}
}  // namespace

CurveTable::CurveTable(const TrainConfig& c, const References* ref)
    : ref_(ref),
      scaler_(c.scaler),
      scaled_(c.scaler != ch06::Scaler::none),
      table_(curve_columns(scaled_)) {}

void CurveTable::add(std::size_t index, int step, const StepResult& result, bool shown) {
  if (steps_++ == 0) first_scale_ = result.loss_scale;
  skipped_ += result.skipped;
  if (!shown) return;
  auto ref_cell = [&](auto f) { return ref_ ? shardlab::Cell(f()) : shardlab::Cell(""); };
  std::vector<shardlab::Cell> row{
      step,
      ref_cell([&] { return ref_->whole.loss[index]; }),
      result.loss,
      ref_cell([&] { return relative(result.loss, ref_->whole.loss[index]); }),
      ref_cell([&] { return relative(ref_->pieces.loss[index], ref_->whole.loss[index]); }),
      result.grad_norm};
  if (scaled_) row.insert(row.end(), {shardlab::Cell(result.loss_scale), shardlab::Cell(skipped_)});
  table_.add(row);
}

std::string CurveTable::dead_run() const {
  return scaled_ ? ch06::no_step_taken(scaler_, skipped_, steps_, first_scale_) : "";
}

void compare_with_one_device(Context& ctx, const References& ref, const std::vector<double>& mesh,
                             double validation) {
  double worst = 0, order = 0, vdiff = 0, vorder = 0;  // rank 0's: it holds both curves
  auto most = [](double& m, double d) {
    m = std::isnan(d) || std::isnan(m) ? NAN : std::max(m, d);
  };
  if (ctx.rank() == 0) {
    for (std::size_t t = 0; t < mesh.size(); ++t) {
      most(worst, relative(mesh[t], ref.whole.loss[t]));
      most(order, relative(ref.pieces.loss[t], ref.whole.loss[t]));
    }
    vdiff = relative(validation, ref.whole.validation);
    vorder = relative(ref.pieces.validation, ref.whole.validation);
  }
  ch08::report_vs_one_device(
      ctx,
      {{.what = "the training loss, worst step", .diff = worst, .order_alone = order},
       {.what = "the validation loss",
        .diff = vdiff,
        .order_alone = vorder,
        .one_device = ref.whole.validation,
        .mesh = validation}},
      {.least = kTolerance, .times = kOrder, .worst_of_all = true},
      "\nthe mesh against one device, relative; order alone: one device with the batch in the "
      "mesh's pieces (the worst, step or validation, x " +
          shardlab::format_number(kOrder) + " is the tolerance; at least " +
          shardlab::format_number(kTolerance) + ")");
}

}  // namespace ch09

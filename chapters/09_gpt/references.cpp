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
  c.mesh = {.pp = 1, .dp = 1, .tp = 1};
  c.microbatches = microbatches;
  c.zero = 0;
  c.schedule = "1f1b";
  c.chunks = 1;
  Mesh mesh(self, c.mesh);
  GptModel model(mesh, c.model, c.model_options());
  Trainer trainer(mesh, model, c, data);
  Curve out;
  for (int t = 0; t < steps; ++t) out.add(trainer.step(t));
  out.validation = trainer.evaluate(data.validation(16));
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

void compare_with_one_device(Context& ctx, const References& ref, const Curve& mesh,
                             double validation) {
  // The worst step of a per-step quantity, on the mesh and one device again in pieces, each
  // against one device (rank 0's: it holds the curves).
  struct Worst {
    double diff = 0, order = 0;
  };
  auto most = [](double& m, double d) {
    m = std::isnan(d) || std::isnan(m) ? NAN : std::max(m, d);
  };
  auto worst = [&](std::vector<double> Curve::*of) {
    Worst w;
    if (ctx.rank() != 0) return w;
    for (std::size_t t = 0; t < (mesh.*of).size(); ++t) {
      most(w.diff, relative((mesh.*of)[t], (ref.whole.*of)[t]));
      most(w.order, relative((ref.pieces.*of)[t], (ref.whole.*of)[t]));
    }
    return w;
  };
  const Worst loss = worst(&Curve::loss);
  double vdiff = 0, vorder = 0;
  if (ctx.rank() == 0) {
    vdiff = relative(validation, ref.whole.validation);
    vorder = relative(ref.pieces.validation, ref.whole.validation);
  }
  std::vector<ch08::Agreement> rows{
      {.what = "the training loss, worst step", .diff = loss.diff, .order_alone = loss.order},
      {.what = "the validation loss",
       .diff = vdiff,
       .order_alone = vorder,
       .one_device = ref.whole.validation,
       .mesh = validation}};
  // With experts, the routing of the first step: from the same weights, each sequence
  // routed on its own, the mesh drops exactly the choices one device drops, and its aux
  // loss is one device's but for the order of its sums. (Later steps route from weights
  // that differ by what the order of additions does, and the routing, a choice, turns
  // those bits into whole tokens sent elsewhere: the curve's table shows both.)
  if (ctx.comm().agree(mesh.aux.empty() || mesh.aux.front() == 0 ? 0.0 : 1.0,
                       shardlab::ReduceOp::max) > 0) {
    auto first = [&](std::vector<double> Curve::*of, double& diff, double& order) {
      if (ctx.rank() != 0) return;
      diff = relative((mesh.*of)[0], (ref.whole.*of)[0]);
      order = relative((ref.pieces.*of)[0], (ref.whole.*of)[0]);
    };
    ch08::Agreement aux{.what = "the aux loss, first step", .own_least = kTolerance},
        dropped{.what = "the dropped choices, first step", .own_least = 0.0};
    first(&Curve::aux, aux.diff, aux.order_alone);
    first(&Curve::dropped, dropped.diff, dropped.order_alone);
    if (ctx.rank() == 0) {
      aux.one_device = ref.whole.aux[0], aux.mesh = mesh.aux[0];
      dropped.one_device = ref.whole.dropped[0], dropped.mesh = mesh.dropped[0];
    }
    rows.push_back(aux);
    rows.push_back(dropped);
  }
  const double times = rows.size() > 2 ? kOrderExperts : kOrder;
  ch08::report_vs_one_device(
      ctx, rows, {.least = kTolerance, .times = times, .worst_of_all = true},
      "\nthe mesh against one device, relative; order alone: one device with the batch in the "
      "mesh's pieces (the worst, step or validation, x " +
          shardlab::format_number(times) + " is the tolerance; at least " +
          shardlab::format_number(kTolerance) + ")" +
          (rows.size() > 2 ? "; the first step's routing is held to its own order alone, the "
                             "dropped choices exactly"
                           : ""));
}

}  // namespace ch09

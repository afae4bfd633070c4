// Chapter 04's own model on the pipeline runtime (toy_stage.hpp).
#include "toy_stage.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

namespace ch04 {

using shardlab::shard_range;

shardlab::toy::MlpConfig mlp_config(const ModelConfig& cfg) {
  return {.widths = std::vector<std::int64_t>(static_cast<std::size_t>(cfg.layers) + 1, cfg.width),
          .bias = true,
          .tanh_last = true,
          .seed = cfg.seed,
          .prefix = "block"};
}

Batch make_batch(const ModelConfig& cfg) {
  const std::uint64_t seed = cfg.seed * 1000003 + 0xba7c4ull;
  return {shardlab::randn(cfg.batch, cfg.width, seed),
          shardlab::randn(cfg.batch, cfg.width, seed + 1)};
}

ToyStage::ToyStage(const ModelConfig& cfg, int stage, int stages, int chunks, Memory memory)
    : cfg_(cfg), memory_(memory) {
  const shardlab::toy::MlpConfig mlp = mlp_config(cfg);
  for (int c = 0; c < chunks; ++c) {
    const auto r = shard_range(cfg.layers, stages * chunks, virtual_stage(stage, c, stages));
    chunks_.push_back(shardlab::toy::mlp(store_, mlp, static_cast<int>(r.offset),
                                         static_cast<int>(r.offset + r.length)));
  }
  store_.allocate(memory);
}

Stage ToyStage::stage(const Batch& batch, int microbatches) {
  Stage st;
  for (nn::Sequential& chunk : chunks_) st.chunks.push_back(&chunk);
  const std::int64_t rows = batch.x.rows(), width = cfg_.width;
  const Memory memory = memory_;
  auto rows_of = [rows, microbatches](int j) { return shard_range(rows, microbatches, j); };
  st.input = [&batch, rows_of, memory](int j) {
    const auto r = rows_of(j);
    return batch.x.slice(r.offset, r.length).to(memory);
  };
  st.boundary = [rows_of, width](int j, int) { return Boundary{{rows_of(j).length, width}}; };
  st.loss = [&batch, rows_of, rows, memory](const Tensor& out, int j) {
    const auto r = rows_of(j);
    const Tensor target = batch.y.slice(r.offset, r.length).to(memory);
    return MicrobatchLoss{nn::squared_error(out, target) / (2.0 * static_cast<double>(rows)),
                          nn::mse_backward(out, target, static_cast<double>(rows))};
  };
  st.memory = memory;
  return st;
}

void run_reference(const ModelConfig& cfg, const Batch& batch, Reference& out) {
  out.model = shardlab::toy::mlp(out.store, mlp_config(cfg));
  out.store.allocate();
  nn::Forward f = out.model.forward(batch.x);
  out.loss = nn::squared_error(f.out, batch.y) / (2.0 * cfg.batch);
  out.model.backward(nn::mse_backward(f.out, batch.y, static_cast<double>(cfg.batch)), f.saved);
}

double max_gradient_diff(ToyStage& model, Reference& ref) {
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

Measured measure(Pipeline& pipeline, const Schedule& s, const ModelConfig& cfg, const Batch& batch,
                 Reference& ref, Memory memory, int batch_microbatches) {
  Communicator& comm = pipeline.comm();
  ToyStage model(cfg, comm.rank(), s.stages, s.chunks, memory);
  const Timed timed = time_schedule(pipeline, s, model.stage(batch, s.microbatches),
                                    [&] { model.store().zero_grad(); });
  Measured r{s, timed.timeline, simulate(s, measured_costs(timed.events))};
  count_in_microbatches(r.measured, s, batch_microbatches);
  count_in_microbatches(r.simulated, s, batch_microbatches);
  r.grad_diff = max_gradient_diff(model, ref);
  r.loss = comm.agree(timed.run.loss, shardlab::ReduceOp::sum);
  r.bytes = static_cast<std::uint64_t>(
      comm.agree(static_cast<std::int64_t>(timed.run.bytes_sent), shardlab::ReduceOp::sum));
  return r;
}

std::uint64_t formula_bytes(const ModelConfig& cfg, int stages, int chunks) {
  if (stages == 1) return 0;
  return 2ull * static_cast<std::uint64_t>(stages * chunks - 1) *
         static_cast<std::uint64_t>(cfg.batch) * static_cast<std::uint64_t>(cfg.width) * 4ull;
}

double bytes_per_rank(const ModelConfig& cfg, int ranks) {
  const double L = cfg.layers, d = cfg.width, B = cfg.batch;
  return 4.0 * (2 * L * d * d / ranks + 3 * B * d * L / ranks) +
         4.0 * (2 * L * d * d + 3 * B * d * L + 2 * B * d);
}

}  // namespace ch04

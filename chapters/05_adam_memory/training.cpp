// Chapter 05's training loop: one model, four ways of keeping its states.
#include "training.hpp"

#include <algorithm>
#include <cmath>

#include "calculator.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/timer.hpp"

using namespace shardlab;
using memory::Category;
using Scope = memory::Scope;

namespace ch05 {

std::string precision_name(Precision p) { return p == Precision::fp32 ? "fp32" : "mixed"; }
DType weight_type(Precision p) { return p == Precision::mixed ? DType::f16 : DType::f32; }

toy::MlpConfig ModelConfig::mlp() const {
  toy::MlpConfig c{.widths = {width}, .bias = false, .tanh_last = true, .seed = seed};
  for (int b = 0; b < blocks; ++b) c.widths.insert(c.widths.end(), {4LL * width, width});
  return c;
}

std::vector<std::int64_t> ModelConfig::groups() const {
  return std::vector<std::int64_t>(static_cast<std::size_t>(blocks), block_params());
}

std::int64_t shard_elements(const ModelConfig& model, int stage, int ranks, int rank) {
  return zero_shard_elements(model.groups(), stage, ranks, rank);
}

StateBytes formula_states(const ModelConfig& model, const RunConfig& run, int ranks, int rank) {
  return zero_state_bytes(model.groups(), run.zero, weight_type(run.precision), ranks, rank);
}

std::uint64_t formula_comm_bytes(const ModelConfig& model, const RunConfig& run, int ranks,
                                 int rank) {
  return zero_comm_bytes(model.groups(), run.zero.stage, weight_type(run.precision), ranks, rank);
}

std::uint64_t formula_activations(const ModelConfig& model, const RunConfig& run) {
  const std::uint64_t w = dtype_size(weight_type(run.precision));
  const auto per_block =
      static_cast<std::uint64_t>(model.batch) * model.width * (run.checkpoint ? 1 : 5);
  return w * per_block * static_cast<std::uint64_t>(model.blocks);
}

namespace {

/// One training step on this rank's rows, every block through the optimizer's calls
/// (zero.hpp); returns its squared error.
// [zero_step]
double step(ZeroOptimizer& opt, std::vector<nn::Sequential>& blocks, const Tensor& x,
            const Tensor& y, const RunConfig& run, double rows, std::uint64_t* after_forward) {
  const DType type = weight_type(run.precision);
  const std::size_t L = blocks.size();
  std::vector<nn::Saved> saved(L);
  std::vector<Tensor> inputs(L);  // checkpointing: what each block keeps
  // Forward.
  const std::uint64_t before = memory::usage().live(Category::activations);
  Tensor h = x;
  for (std::size_t b = 0; b < L; ++b) {
    opt.gather(static_cast<int>(b));
    {
      Scope scope(Category::activations);
      nn::Forward f = blocks[b].forward(h);
      if (run.checkpoint)
        inputs[b] = h;  // the rest of f.saved goes now
      else
        saved[b] = std::move(f.saved);
      h = std::move(f.out);
    }
    opt.release(static_cast<int>(b));
  }
  if (after_forward) *after_forward = memory::usage().live(Category::activations) - before;
  // Loss: sum of squares over every rank's rows / (2 N B); its gradient (h - y) / (N B).
  Tensor dh;
  double sse = 0;
  {
    Scope scope(Category::activations);
    const Tensor h32 = cast(h, DType::f32);
    sse = nn::squared_error(h32, y);
    dh = cast(nn::mse_backward(h32, y, rows), type);
  }
  h = Tensor();
  // Backward, last block first; the optimizer says where each block's gradients go.
  for (std::size_t b = L; b-- > 0;) {
    const int g = static_cast<int>(b);
    opt.gather(g);
    opt.prepare_gradients(g);
    {
      Scope scope(Category::activations);
      if (run.checkpoint) saved[b] = blocks[b].forward(inputs[b]).saved;  // time for memory
      dh = blocks[b].backward(dh, saved[b]);
      saved[b] = nn::Saved{};
      inputs[b] = Tensor();
    }
    opt.reduce_gradients(g);
    opt.release(g);
  }
  opt.step();
  return sse;
}
// [zero_step]

}  // namespace

RunResult train(Communicator& comm, const ModelConfig& model, const RunConfig& run, Memory memory) {
  const int N = comm.size(), r = comm.rank();
  const std::int64_t B = model.batch;
  const DType type = weight_type(run.precision);
  // This rank's rows of one data set: x ~ N(0, 1), y = tanh(x T) for the teacher's T.
  Tensor x, y;
  {
    const toy::Teacher teacher(
        toy::MlpConfig{.widths = {model.width, model.width}, .bias = false, .tanh_last = true},
        model.seed);
    const toy::Batch all = teacher.batch(N * B, 0);
    x = cast(all.x.slice(r * B, B), type).to(memory);
    y = all.y.slice(r * B, B).clone().to(memory);
  }
  // The model: block b is layers 2b and 2b + 1 of toy.hpp's MLP. Its initial weights are
  // made before the ledger starts counting the run.
  nn::ParameterStore store;
  std::vector<nn::Sequential> blocks;
  std::vector<std::vector<nn::Parameter*>> groups;
  for (int b = 0; b < model.blocks; ++b) {
    blocks.push_back(toy::mlp(store, model.mlp(), 2 * b, 2 * b + 2));
    groups.push_back(blocks.back().parameters());
  }
  RunResult result;
  memory::Tracker tracker;
  store.allocate(memory, type);
  ZeroOptimizer opt(comm, store, run.zero, groups);
  result.shard = opt.shard_elements();
  const double rows = static_cast<double>(N) * static_cast<double>(B);
  const CommStats before = comm.stats();
  for (int t = 1; t <= run.steps; ++t) {
    comm.barrier();
    Stopwatch watch;
    const double sse =
        step(opt, blocks, x, y, run, rows, t == 1 ? &result.activations_after_forward : nullptr);
    if (memory == Memory::device) cuda::synchronize();  // the clock stops when the GPU is done
    const double took = watch.seconds();
    if (t == 1 && run.keep_grads && run.zero.stage == 0)
      result.first_grads = cast(store.grads(), DType::f32).to(Memory::host);
    result.fastest_step_s = t == 1 ? took : std::min(result.fastest_step_s, took);
    result.losses.push_back(comm.agree(sse, ReduceOp::sum) / (2.0 * rows));
  }
  result.comm = comm.stats().since(before);
  // The barriers of the loop are not part of training's traffic.
  result.comm[Op::barrier] = OpStats{};
  const memory::Usage u = tracker.usage();
  result.states = {u.live(Category::params), u.live(Category::grads), u.live(Category::master),
                   u.live(Category::optimizer)};
  result.usage = u;
  result.fastest_step_s = comm.agree(result.fastest_step_s, ReduceOp::max);
  result.weights = opt.weights().to(Memory::host);
  return result;
}

Measured measure(Communicator& comm, const ModelConfig& model, const RunConfig& run,
                 Memory memory) {
  Measured m;
  m.run = train(comm, model, run, memory);
  m.formula = formula_states(model, run, comm.size(), comm.rank());
  m.paper =
      zero_memory(static_cast<double>(model.params()), comm.size(), run.zero.stage, run.precision)
          .total();
  if (run.zero.sgd) m.paper = 0;  // the paper counts Adam
  m.comm_bytes = m.run.comm.total().bytes_received / static_cast<std::uint64_t>(run.steps);
  m.comm_formula = formula_comm_bytes(model, run, comm.size(), comm.rank());
  m.blocks = model.blocks;
  m.rank = comm.rank();
  return m;
}

std::string Measured::differences(bool traffic_measured) const {
  std::string out;
  auto compare = [&](const char* what, std::uint64_t measured, std::uint64_t want) {
    if (measured != want)
      out += std::string(out.empty() ? "" : "; ") + what + " measured " + std::to_string(measured) +
             " bytes on rank " + std::to_string(rank) + ", the formula says " +
             std::to_string(want);
  };
  const StateBytes& b = run.states;
  compare("params", b.params, formula.params);
  compare("grads", b.grads, formula.grads);
  compare("master", b.master, formula.master);
  compare("optimizer", b.optimizer, formula.optimizer);
  if (traffic_measured) compare("traffic per step", comm_bytes, comm_formula);
  const double off = std::abs(static_cast<double>(formula.total()) - paper);
  if (paper > 0 && off > 16.0 * blocks + 16)
    out += std::string(out.empty() ? "" : "; ") + "the exact formula is " +
           std::to_string(formula.total()) + " bytes, further from the paper's " +
           format_number(paper) + " than uneven shards explain";
  return out;
}

BenchmarkTables benchmark(Communicator& comm, const ModelConfig& model, RunConfig run,
                          Memory memory) {
  BenchmarkTables out;
  const std::string machine = machine_description(), backend(comm.backend());
  const std::string precision = precision_name(run.precision);
  for (int nd = 1; nd <= comm.size(); nd *= 2) {
    // Ranks 0..nd-1 train together; the others form groups of their own.
    std::unique_ptr<Communicator> group = comm.split(comm.rank() / nd, comm.rank());
    double plain = 0;
    for (int stage = 0; stage <= 3; ++stage)
      for (bool prefetch : {true, false}) {
        if (stage < 3 && !prefetch) continue;
        run.zero.stage = stage;
        run.zero.prefetch = prefetch;
        const Measured m = measure(*group, model, run, memory);
        const double t = comm.agree(m.run.fastest_step_s, ReduceOp::max);
        if (stage == 0) plain = t;
        out.time.add({stage, prefetch ? 1 : 0, group->size(), t * 1e3, t / plain, model.params(),
                      precision, backend, machine});
        if (!prefetch) continue;
        for (const auto& [source, b] :
             {std::pair{"measured", m.run.states}, {"formula", m.formula}})
          for (const auto& [category, bytes] : {std::pair{"params", b.params},
                                                {"grads", b.grads},
                                                {"master", b.master},
                                                {"optimizer", b.optimizer}})
            out.bytes.add(
                {source, stage, group->size(), category, bytes, model.params(), precision});
      }
  }
  return out;
}

double memory_estimate(const ModelConfig& model, int here, int ranks) {
  const double P = static_cast<double>(model.params());
  const double rows = static_cast<double>(model.batch) * ranks * model.width;
  const double activations = 12.0 * model.batch * model.width * model.blocks;
  // Measured peaks (d 128-512, 2-8 blocks, 256-8192 rows, 1-4 ranks): 0.7-0.9 of this.
  return here * (60.0 * P + 12.0 * rows + 5 * activations);
}

}  // namespace ch05

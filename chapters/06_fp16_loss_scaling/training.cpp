// Chapter 06's training loop: the same model in fp32, in fp16 without scaling, and in
// fp16 with a loss scale.
#include "training.hpp"

#include <cmath>
#include <limits>

#include "shardlab/check.hpp"
#include "shardlab/half.hpp"
#include "shardlab/nn.hpp"

using namespace shardlab;

namespace ch06 {

double underflow_fraction(const std::vector<float>& gradients, float scale) {
  std::size_t nonzero = 0, lost = 0;
  for (float g : gradients) {
    if (g == 0.0f) continue;
    ++nonzero;
    const std::uint16_t h = float_to_half_bits(g * scale);
    if ((h & 0x7fff) == 0) ++lost;  // +0 or -0: the value is gone
  }
  return nonzero ? static_cast<double>(lost) / static_cast<double>(nonzero) : 0.0;
}

namespace {

void append(std::vector<float>& into, const Tensor& t) {
  const Tensor f = cast(t, DType::f32).to(Memory::host);
  into.insert(into.end(), f.begin(), f.end());
}

}  // namespace

RunResult train(Communicator& comm, const ModelConfig& model, const RunConfig& run,
                Memory memory) {
  const int N = comm.size(), r = comm.rank();
  require(model.rows >= N, [&] {
    return "ch06: " + std::to_string(model.rows) + " rows cannot give " + std::to_string(N) + " ranks one each";
  });
  const std::int64_t I = model.in, H = model.hidden, O = model.out, R = model.rows;
  const ShardRange mine = shard_range(R, N, r);
  const DType type = run.fp16 ? DType::f16 : DType::f32;
  // This rank's rows of one data set, and the same initial weights on every rank.
  const Tensor all_x = randn(Shape{R, I}, model.seed * 7919 + 1);
  const Tensor teacher = scale(randn(Shape{I, O}, model.seed * 7919 + 2),
                               1.0f / std::sqrt(static_cast<float>(I)));
  const Tensor all_y = scale(tanh(matmul(all_x, teacher)), static_cast<float>(model.target_scale));
  const Tensor x = cast(all_x.slice(mine.offset, mine.length), type).to(memory);
  const Tensor y = all_y.slice(mine.offset, mine.length).clone().to(memory);
  const std::int64_t P = model.params();
  Tensor master(Shape{P}, DType::f32);
  master.view(0, Shape{I, H})
      .copy_from(scale(randn(Shape{I, H}, model.seed * 7919 + 3), 1.0f / std::sqrt(static_cast<float>(I))));
  // W2 starts at the targets' size: the outputs are small from the first step.
  master.view(I * H, Shape{H, O})
      .copy_from(scale(randn(Shape{H, O}, model.seed * 7919 + 4),
                       static_cast<float>(model.target_scale) / std::sqrt(static_cast<float>(H))));
  master = master.to(memory);
  Tensor m(Shape{P}, DType::f32, memory), v(Shape{P}, DType::f32, memory);
  Tensor grads(Shape{P}, type, memory), unscaled(Shape{P}, DType::f32, memory);
  const nn::AdamConfig adam{.lr = run.lr};
  DynamicScaler dynamic(run.dynamic);
  RunResult result;
  int adam_steps = 0;
  const double count = static_cast<double>(R * O);
  for (int t = 1; t <= run.steps; ++t) {
    const float loss_scale = !run.fp16 || run.scaler == Scaler::none ? 1.0f
                             : run.scaler == Scaler::fixed          ? run.static_scale
                                                                     : dynamic.scale();
    result.scales.push_back(loss_scale);
    // Forward, in the compute type: fp16 weights are the master weights rounded.
    const Tensor w = cast(master, type);
    const Tensor w1 = w.view(0, Shape{I, H}), w2 = w.view(I * H, Shape{H, O});
    const Tensor h = tanh(matmul(x, w1));
    const Tensor out = matmul(h, w2);
    // The loss in fp32; its gradient, times the scale, rounded to the compute type:
    // where fp16 loses the small ones.
    const Tensor out32 = cast(out, DType::f32);
    result.losses.push_back(comm.agree(nn::squared_error(out32, y), ReduceOp::sum) / (2.0 * count));
    const Tensor err = sub(out32, y);
    Tensor dout32 = scale(err, static_cast<float>(loss_scale / count));
    const Tensor dout = cast(dout32, type);
    // Backward, in the compute type, into the flat gradient buffer.
    Tensor g1 = grads.view(0, Shape{I, H}), g2 = grads.view(I * H, Shape{H, O});
    matmul_into(g2, h, dout, true, false);
    const Tensor dh = matmul(dout, w2, false, true);
    const Tensor da = tanh_backward(h, dh);
    matmul_into(g1, x, da, true, false);
    if (t == 1) {
      if (!run.fp16)
        for (const Tensor* g : std::initializer_list<const Tensor*>{&dout, &dh, &da, &g1, &g2})
          append(result.first_gradients, *g);
      std::vector<float> weight_grads;
      append(weight_grads, grads);
      std::size_t zero = 0;
      for (float g : weight_grads) zero += g == 0.0f;
      result.first_zero_weight_grads = static_cast<double>(zero) / static_cast<double>(weight_grads.size());
    }
    // The gradients of every rank's rows, summed in the compute type: fp16 moves half
    // the bytes of fp32.
    const CommStats before = comm.stats();
    comm.allreduce(grads, ReduceOp::sum);
    const CommStats moved = comm.stats().since(before);
    result.grad_bytes_per_step = moved[Op::allreduce].bytes_received;
    result.grad_traffic_modeled = moved.is_modeled(Op::allreduce);
    // --inject-overflow: one rank's gradients turn non-finite (as one rank's shard would
    // under ZeRO or FSDP); the others' stay finite.
    if (run.inject_overflow.count(t) && r == N - 1) {
      Tensor first = grads.slice(0, 1);
      first.fill(std::numeric_limits<double>::infinity());
    }
    bool skip = false;
    if (run.fp16 && run.scaler != Scaler::none) {
      skip = unscale_and_check(comm, grads, unscaled, loss_scale);
    } else {
      unscaled.copy_from(grads.dtype() == DType::f32 ? grads : cast(grads, DType::f32));
    }
    if (skip) {
      result.skipped.push_back(t);
    } else {
      nn::adam_update(master, unscaled, m, v, ++adam_steps, adam);
    }
    if (run.fp16 && run.scaler == Scaler::dynamic) dynamic.update(skip);
    // A rank that stepped while another skipped would leave the replicas apart for good.
    const int skips = comm.agree(skip ? 1 : 0, ReduceOp::sum);
    if (skips != 0 && skips != N) result.skips_agreed = false;
  }
  result.weights = master.to(Memory::host);
  return result;
}

}  // namespace ch06

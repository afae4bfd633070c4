// Chapter 07's MoE arithmetic that the one-device reference (moe.cpp) and the
// expert-parallel layer (moe_layer.cpp) share: the router's softmax, the combine, and the
// backward through the gates and the router.
#pragma once

#include <cstdint>
#include <vector>

#include "moe.hpp"

namespace ch07 {

/// The seed expert e's weights are drawn from.
std::uint64_t expert_seed(const MoeConfig& c, int e);

/// Row-wise softmax of x @ router, on the host.
shardlab::Tensor router_probs(const shardlab::Tensor& x, const shardlab::Tensor& router);

/// f_i: the fraction of the routing's tokens (one rank's) whose first choice is expert i
/// (summed token by token).
std::vector<float> first_choice_fractions(const Routing& r);

/// Index tensor of rows.
shardlab::Tensor index_of(const std::vector<int>& rows, shardlab::Memory memory);

/// y = x + sum over kept choices, in j order, of gate * the expert's output for it. `row`
/// maps a choice to its row of `outs` (-1: dropped). Tokens [offset, offset + rows).
shardlab::Tensor combine(const shardlab::Tensor& x, const Routing& r, std::int64_t offset,
                         const std::vector<int>& row, const shardlab::Tensor& outs);

/// dL/dgate of every kept choice of tokens [offset, offset + rows): dy . the expert's
/// output.
std::vector<float> gate_grads(const shardlab::Tensor& dy, const Routing& r, std::int64_t offset,
                              const std::vector<int>& row, const shardlab::Tensor& outs);

/// dL/dlogits of tokens [offset, offset + rows), all of one rank: through the gates
/// (renormalised for k > 1) and the aux loss (f, that rank's, held constant; its aux loss
/// weighted by its share of the T tokens, so d/dp_i = alpha E f_i / T), then the softmax.
shardlab::Tensor router_grad(const MoeConfig& c, const Routing& r, std::int64_t offset,
                             const shardlab::Tensor& probs, const std::vector<float>& dgate,
                             const std::vector<float>& f);

/// dx = dy + the experts' dL/dx rows (in j order) + dlogits @ router^T.
shardlab::Tensor input_grad(const shardlab::Tensor& dy, const Routing& r, std::int64_t offset,
                            const std::vector<int>& row, const shardlab::Tensor& dins,
                            const shardlab::Tensor& dlogits, const shardlab::Tensor& router);

}  // namespace ch07

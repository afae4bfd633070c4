// Chapter 07's MoE arithmetic that the one-device reference (moe.cpp) and the
// expert-parallel layer (moe_layer.cpp) share (combine.hpp).
#include "combine.hpp"

#include <algorithm>
#include <cmath>

using namespace shardlab;

namespace ch07 {

std::uint64_t expert_seed(const MoeConfig& c, int e) {
  return c.seed * 7919 + 100 + 2 * static_cast<std::uint64_t>(e);
}

Tensor router_probs(const Tensor& x, const Tensor& router) {
  Tensor p = matmul(x, router).to(Memory::host);
  for (std::int64_t t = 0; t < p.rows(); ++t) {
    float top = p(t, 0);
    for (std::int64_t e = 1; e < p.cols(); ++e) top = std::max(top, p(t, e));
    float sum = 0;
    for (std::int64_t e = 0; e < p.cols(); ++e) sum += (p(t, e) = std::exp(p(t, e) - top));
    for (std::int64_t e = 0; e < p.cols(); ++e) p(t, e) /= sum;
  }
  return p;
}

std::vector<float> first_choice_fractions(const Routing& r) {
  std::vector<float> f(idx(r.experts), 0.0f);
  for (int t = 0; t < r.tokens; ++t)
    f[idx(r.expert[idx(r.at(t, 0))])] += 1.0f / static_cast<float>(r.tokens);
  return f;
}

Tensor index_of(const std::vector<int>& rows, Memory memory) {
  std::vector<std::int32_t> v(rows.begin(), rows.end());
  return Tensor::from_vector(v).to(memory);
}

Tensor combine(const Tensor& x, const Routing& r, std::int64_t offset, const std::vector<int>& row,
               const Tensor& outs) {
  Tensor y = x.to(Memory::host).clone();
  const Tensor o = outs.to(Memory::host);
  const std::int64_t d = y.cols();
  for (std::int64_t t = 0; t < y.rows(); ++t)
    for (int j = 0; j < r.k; ++j) {
      const Index c = idx(r.at(static_cast<int>(offset + t), j));
      if (row[c] < 0) continue;
      const float g = r.gate[c];
      for (std::int64_t i = 0; i < d; ++i) y(t, i) += g * o(row[c], i);
    }
  return y;
}

std::vector<float> gate_grads(const Tensor& dy, const Routing& r, std::int64_t offset,
                              const std::vector<int>& row, const Tensor& outs) {
  std::vector<float> dg(idx(r.tokens * r.k), 0.0f);
  const Tensor o = outs.to(Memory::host), g = dy.to(Memory::host);
  for (std::int64_t t = 0; t < g.rows(); ++t)
    for (int j = 0; j < r.k; ++j) {
      const Index c = idx(r.at(static_cast<int>(offset + t), j));
      if (row[c] < 0) continue;
      float s = 0;
      for (std::int64_t i = 0; i < g.cols(); ++i) s += g(t, i) * o(row[c], i);
      dg[c] = s;
    }
  return dg;
}

Tensor router_grad(const MoeConfig& c, const Routing& r, std::int64_t offset, const Tensor& probs,
                   const std::vector<float>& dgate, const std::vector<float>& f) {
  const std::int64_t rows = probs.rows(), E = c.experts;
  Tensor dlogits(rows, E);
  std::vector<float> dp(idx(c.experts));
  const float aux = static_cast<float>(c.aux_alpha * c.experts / c.tokens);
  for (std::int64_t t = 0; t < rows; ++t) {
    for (int e = 0; e < c.experts; ++e) dp[idx(e)] = aux * f[idx(e)];
    const int tt = static_cast<int>(offset + t);
    if (c.k == 1) {
      const Index ch = idx(r.at(tt, 0));
      dp[idx(r.expert[ch])] += dgate[ch];
    } else {
      // gate_j = p_j / S, S = sum of the chosen p: dgate_j/dp_i = [i == j] / S - p_j / S^2.
      float S = 0, weighted = 0;
      for (int j = 0; j < c.k; ++j) S += probs(t, r.expert[idx(r.at(tt, j))]);
      for (int j = 0; j < c.k; ++j) {
        const Index ch = idx(r.at(tt, j));
        weighted += dgate[ch] * probs(t, r.expert[ch]);
      }
      for (int j = 0; j < c.k; ++j) {
        const Index ch = idx(r.at(tt, j));
        dp[idx(r.expert[ch])] += dgate[ch] / S - weighted / (S * S);
      }
    }
    float dot = 0;
    for (std::int64_t e = 0; e < E; ++e) dot += probs(t, e) * dp[static_cast<Index>(e)];
    for (std::int64_t e = 0; e < E; ++e)
      dlogits(t, e) = probs(t, e) * (dp[static_cast<Index>(e)] - dot);
  }
  return dlogits;
}

Tensor input_grad(const Tensor& dy, const Routing& r, std::int64_t offset,
                  const std::vector<int>& row, const Tensor& dins, const Tensor& dlogits,
                  const Tensor& router) {
  Tensor dx = dy.to(Memory::host).clone();
  const Tensor di = dins.to(Memory::host);
  for (std::int64_t t = 0; t < dx.rows(); ++t)
    for (int j = 0; j < r.k; ++j) {
      const Index c = idx(r.at(static_cast<int>(offset + t), j));
      if (row[c] < 0) continue;
      for (std::int64_t i = 0; i < dx.cols(); ++i) dx(t, i) += di(row[c], i);
    }
  const Tensor through_router = matmul(dlogits, router.to(Memory::host), false, true);
  axpy(1.0f, through_router, dx);
  return dx;
}

}  // namespace ch07

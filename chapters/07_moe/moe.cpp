// Chapter 07's MoE layer: the router, the experts, the combine, and their backward — once
// written out on one device (the reference), once as an nn layer whose tokens travel to
// their experts' ranks. Then what the all-to-alls move, the pairwise all-to-all, and the
// training loop.
#include "moe.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>

#include "shardlab/bench.hpp"
#include "shardlab/check.hpp"

using namespace shardlab;

namespace ch07 {

int expert_capacity(int tokens, int k, int experts, double capacity_factor) {
  const double c = std::ceil(static_cast<double>(k) * tokens * capacity_factor / experts - 1e-9);
  // An expert never gets more than every token once: a larger C changes nothing.
  return static_cast<int>(std::clamp(c, 1.0, static_cast<double>(std::max(tokens, 1))));
}

std::string describe(const MoeConfig& c) {
  return std::to_string(c.experts) + " experts, each an MLP " + std::to_string(c.hidden) + " -> " +
         std::to_string(c.ffn) + " -> " + std::to_string(c.hidden) + "; " +
         std::to_string(c.tokens) + " tokens, top-" + std::to_string(c.k) + " routing";
}

double layer_run_bytes(const MoeConfig& c, int ranks) {
  // Every rank runs the one-device reference over every token: its experts' rows, kT of
  // them at most (X, tanh(X W1), the outputs and their gradients: 5 d + 3 h floats each),
  // x, dy, dx and the router's T x E; and holds every expert's weights and their
  // gradients, besides its own share of the layer. The activations of the ranks' runs do
  // not all peak at once: a third of one run per further rank. Measured peaks (T 8192 to
  // 32768, d 256-512, h 512-2048, E 8-64, 1-8 ranks) are 0.7-0.85 of this.
  const double T = c.tokens, d = c.hidden, h = c.ffn, E = c.experts, k = c.k;
  const double run = 4.0 * (1.7 * k * T * (5 * d + 3 * h) + T * (4 * d + 3 * E));
  const double weights = 4.0 * 6 * E * d * h;
  return ranks * weights + run * (1 + 0.35 * (ranks - 1)) + 32.0 * (1 << 20);
}

namespace {

using Index = std::size_t;
Index at(int i) { return static_cast<Index>(i); }

std::uint64_t expert_seed(const MoeConfig& c, int e) {
  return c.seed * 7919 + 100 + 2 * static_cast<std::uint64_t>(e);
}

}  // namespace

Weights make_weights(const MoeConfig& c, int first, int count) {
  const std::int64_t d = c.hidden, h = c.ffn;
  const float in_d = 1.0f / std::sqrt(static_cast<float>(d));
  const float in_h = 1.0f / std::sqrt(static_cast<float>(h));
  Weights w;
  w.first = first;
  w.router = scale(randn(Shape{d, c.experts}, c.seed * 7919 + 1), in_d);
  for (int e = first; e < first + count; ++e) {
    w.w1.push_back(scale(randn(Shape{d, h}, expert_seed(c, e)), in_d));
    w.w2.push_back(scale(randn(Shape{h, d}, expert_seed(c, e) + 1), in_h));
  }
  return w;
}

namespace {

/// Row-wise softmax of x @ router, on the host.
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

/// Every rank's routings as one, token after token of the whole batch (rank 0's tokens
/// first): choice (t, j) of the batch at t k + j. Slots stay per rank.
Routing concatenated(const std::vector<Routing>& routings) {
  Routing all;
  all.experts = routings.front().experts;
  all.k = routings.front().k;
  for (const Routing& r : routings) {
    all.tokens += r.tokens;
    all.capacity = std::max(all.capacity, r.capacity);
    all.expert.insert(all.expert.end(), r.expert.begin(), r.expert.end());
    all.gate.insert(all.gate.end(), r.gate.begin(), r.gate.end());
    all.slot.insert(all.slot.end(), r.slot.begin(), r.slot.end());
  }
  return all;
}

/// Where the experts run every kept choice: per expert, its rows — the kept choices of
/// rank 0's tokens in slot order, then rank 1's, ... (as choices of the whole batch:
/// concatenated()'s indices) — and each choice's row when the experts' outputs are laid
/// one expert after the other (-1 for a dropped choice).
struct Layout {
  std::vector<std::vector<int>> rows;
  std::vector<int> row;
  std::int64_t kept = 0;
};
Layout layout_of(const std::vector<Routing>& routings) {
  const int E = routings.front().experts, k = routings.front().k;
  Layout l;
  l.rows.resize(at(E));
  int first = 0;  // the rank's first choice in the whole batch
  for (const Routing& r : routings) {
    std::vector<std::vector<int>> by_slot(at(E), std::vector<int>(at(r.capacity), -1));
    for (int c = 0; c < r.tokens * k; ++c)
      if (r.slot[at(c)] >= 0) by_slot[at(r.expert[at(c)])][at(r.slot[at(c)])] = first + c;
    for (int e = 0; e < E; ++e)
      for (int c : by_slot[at(e)])
        if (c >= 0) l.rows[at(e)].push_back(c);
    first += r.tokens * k;
  }
  l.row.assign(at(first), -1);
  for (const auto& mine : l.rows)
    for (int c : mine) l.row[at(c)] = static_cast<int>(l.kept++);
  return l;
}

/// f_i: the fraction of the routing's tokens (one rank's) whose first choice is expert i
/// (summed token by token).
std::vector<float> first_choice_fractions(const Routing& r) {
  std::vector<float> f(at(r.experts), 0.0f);
  for (int t = 0; t < r.tokens; ++t)
    f[at(r.expert[at(r.at(t, 0))])] += 1.0f / static_cast<float>(r.tokens);
  return f;
}

/// Index tensor of rows.
Tensor index_of(const std::vector<int>& rows, Memory memory) {
  std::vector<std::int32_t> v(rows.begin(), rows.end());
  return Tensor::from_vector(v).to(memory);
}

/// y = x + sum over kept choices, in j order, of gate * the expert's output for it. `row`
/// maps a choice to its row of `outs` (-1: dropped). Tokens [offset, offset + rows).
Tensor combine(const Tensor& x, const Routing& r, std::int64_t offset, const std::vector<int>& row,
               const Tensor& outs) {
  Tensor y = x.to(Memory::host).clone();
  const Tensor o = outs.to(Memory::host);
  const std::int64_t d = y.cols();
  for (std::int64_t t = 0; t < y.rows(); ++t)
    for (int j = 0; j < r.k; ++j) {
      const Index c = at(r.at(static_cast<int>(offset + t), j));
      if (row[c] < 0) continue;
      const float g = r.gate[c];
      for (std::int64_t i = 0; i < d; ++i) y(t, i) += g * o(row[c], i);
    }
  return y;
}

/// dL/dgate of every kept choice of tokens [offset, offset + rows): dy . the expert's
/// output.
std::vector<float> gate_grads(const Tensor& dy, const Routing& r, std::int64_t offset,
                              const std::vector<int>& row, const Tensor& outs) {
  std::vector<float> dg(at(r.tokens * r.k), 0.0f);
  const Tensor o = outs.to(Memory::host), g = dy.to(Memory::host);
  for (std::int64_t t = 0; t < g.rows(); ++t)
    for (int j = 0; j < r.k; ++j) {
      const Index c = at(r.at(static_cast<int>(offset + t), j));
      if (row[c] < 0) continue;
      float s = 0;
      for (std::int64_t i = 0; i < g.cols(); ++i) s += g(t, i) * o(row[c], i);
      dg[c] = s;
    }
  return dg;
}

/// dL/dlogits of tokens [offset, offset + rows), all of one rank: through the gates
/// (renormalised for k > 1) and the aux loss (f, that rank's, held constant; its aux loss
/// weighted by its share of the T tokens, so d/dp_i = alpha E f_i / T), then the softmax.
Tensor router_grad(const MoeConfig& c, const Routing& r, std::int64_t offset, const Tensor& probs,
                   const std::vector<float>& dgate, const std::vector<float>& f) {
  const std::int64_t rows = probs.rows(), E = c.experts;
  Tensor dlogits(rows, E);
  std::vector<float> dp(at(c.experts));
  const float aux = static_cast<float>(c.aux_alpha * c.experts / c.tokens);
  for (std::int64_t t = 0; t < rows; ++t) {
    for (int e = 0; e < c.experts; ++e) dp[at(e)] = aux * f[at(e)];
    const int tt = static_cast<int>(offset + t);
    if (c.k == 1) {
      const Index ch = at(r.at(tt, 0));
      dp[at(r.expert[ch])] += dgate[ch];
    } else {
      // gate_j = p_j / S, S = sum of the chosen p: dgate_j/dp_i = [i == j] / S - p_j / S^2.
      float S = 0, weighted = 0;
      for (int j = 0; j < c.k; ++j) S += probs(t, r.expert[at(r.at(tt, j))]);
      for (int j = 0; j < c.k; ++j) {
        const Index ch = at(r.at(tt, j));
        weighted += dgate[ch] * probs(t, r.expert[ch]);
      }
      for (int j = 0; j < c.k; ++j) {
        const Index ch = at(r.at(tt, j));
        dp[at(r.expert[ch])] += dgate[ch] / S - weighted / (S * S);
      }
    }
    float dot = 0;
    for (std::int64_t e = 0; e < E; ++e) dot += probs(t, e) * dp[static_cast<Index>(e)];
    for (std::int64_t e = 0; e < E; ++e)
      dlogits(t, e) = probs(t, e) * (dp[static_cast<Index>(e)] - dot);
  }
  return dlogits;
}

/// dx = dy + the experts' dL/dx rows (in j order) + dlogits @ router^T.
Tensor input_grad(const Tensor& dy, const Routing& r, std::int64_t offset,
                  const std::vector<int>& row, const Tensor& dins, const Tensor& dlogits,
                  const Tensor& router) {
  Tensor dx = dy.to(Memory::host).clone();
  const Tensor di = dins.to(Memory::host);
  for (std::int64_t t = 0; t < dx.rows(); ++t)
    for (int j = 0; j < r.k; ++j) {
      const Index c = at(r.at(static_cast<int>(offset + t), j));
      if (row[c] < 0) continue;
      for (std::int64_t i = 0; i < dx.cols(); ++i) dx(t, i) += di(row[c], i);
    }
  const Tensor through_router = matmul(dlogits, router.to(Memory::host), false, true);
  axpy(1.0f, through_router, dx);
  return dx;
}

/// The reference's expert on its rows X (in slot order), written out.
struct ExpertRun {
  Tensor x, h, out;
};
ExpertRun expert_forward(const Tensor& x, const Tensor& w1, const Tensor& w2) {
  ExpertRun run{x, tanh(matmul(x, w1)), {}};
  run.out = matmul(run.h, w2);
  return run;
}
/// dL/dX of the expert's rows, and its weights' gradients.
Tensor expert_backward(const ExpertRun& run, const Tensor& dout, const Tensor& w1, const Tensor& w2,
                       Tensor& dw1, Tensor& dw2) {
  dw2 = matmul(run.h, dout, true, false);
  const Tensor dz = tanh_backward(run.h, matmul(dout, w2, false, true));
  dw1 = matmul(run.x, dz, true, false);
  return matmul(dz, w1, false, true);
}

}  // namespace

RoutingStats& RoutingStats::operator+=(const RoutingStats& o) {
  if (wanted.empty()) wanted.assign(o.wanted.size(), 0), kept.assign(o.kept.size(), 0);
  for (std::size_t e = 0; e < o.wanted.size(); ++e) wanted[e] += o.wanted[e], kept[e] += o.kept[e];
  dropped += o.dropped;
  passed_through += o.passed_through;
  aux_loss += o.aux_loss;
  return *this;
}

RoutingStats routing_stats(const MoeConfig& c, const Routing& r, const Tensor& probs) {
  const int E = c.experts;
  RoutingStats s;
  s.wanted.assign(at(E), 0);
  s.kept.assign(at(E), 0);
  for (int t = 0; t < r.tokens; ++t) {
    bool any = false;
    for (int j = 0; j < c.k; ++j) {
      const Index ch = at(r.at(t, j));
      const Index e = at(r.expert[ch]);
      ++s.wanted[e];
      if (r.slot[ch] >= 0) {
        ++s.kept[e];
        any = true;
      } else {
        ++s.dropped;
      }
    }
    if (!any) ++s.passed_through;
  }
  // alpha E sum_i f_i P_i over this rank's T_r tokens, times T_r / T: alpha E sum_i f_i
  // (sum of p_i over its tokens) / T.
  const std::vector<float> f = first_choice_fractions(r);
  double aux = 0;
  for (int e = 0; e < E; ++e) {
    double P = 0;
    for (int t = 0; t < r.tokens; ++t) P += probs(t, e);
    aux += f[at(e)] * (P / c.tokens);
  }
  s.aux_loss = c.aux_alpha * E * aux;
  return s;
}

RoutingStats combined(Communicator& comm, const RoutingStats& mine) {
  Communicator::Uncounted quiet(comm);
  RoutingStats all = mine;
  std::vector<std::int32_t> counts;
  for (const auto* v : {&mine.wanted, &mine.kept})
    counts.insert(counts.end(), v->begin(), v->end());
  counts.push_back(mine.dropped);
  counts.push_back(mine.passed_through);
  comm.allreduce(counts, ReduceOp::sum);  // integers: every order gives the same sums
  const std::size_t E = mine.wanted.size();
  for (std::size_t e = 0; e < E; ++e) all.wanted[e] = counts[e], all.kept[e] = counts[E + e];
  all.dropped = counts[2 * E];
  all.passed_through = counts[2 * E + 1];
  all.aux_loss = comm.agree(mine.aux_loss, ReduceOp::sum);  // in rank order on every backend
  return all;
}

Result moe_reference(const MoeConfig& c, const Weights& all, const Tensor& x, const Tensor& dy,
                     int ranks) {
  require(x.ndim() == 2 && x.rows() == c.tokens && x.cols() == c.hidden &&
              static_cast<int>(all.w1.size()) == c.experts && (!dy.defined() || dy.same_shape(x)) &&
              ranks >= 1,
          [&] {
            return "moe_reference: x " + x.describe() + ", dy " +
                   (dy.defined() ? dy.describe() : "none") + " for " + std::to_string(c.tokens) +
                   " tokens of " + std::to_string(c.hidden) + " and " +
                   std::to_string(all.w1.size()) + " of " + std::to_string(c.experts) +
                   " experts, on " + std::to_string(ranks) + " ranks";
          });
  Result out;
  const Tensor probs = router_probs(x, all.router);
  // Each rank's tokens routed on their own, with that rank's capacity.
  std::vector<ShardRange> shards;
  RoutingStats stats;
  for (int q = 0; q < ranks; ++q) {
    const ShardRange sh = shard_range(c.tokens, ranks, q);
    shards.push_back(sh);
    const Tensor mine = probs.slice(sh.offset, sh.length);
    out.routings.push_back(route(mine, c.k, c.capacity(q, ranks)));
    stats += routing_stats(c, out.routings.back(), mine);
  }
  out.stats = stats;
  const Routing r = concatenated(out.routings);
  const Layout layout = layout_of(out.routings);
  // Each expert runs its rows, gathered straight from x: by source rank, then slot.
  Tensor outs(layout.kept, c.hidden);
  std::vector<ExpertRun> runs;
  std::int64_t offset = 0;
  for (int e = 0; e < c.experts; ++e) {
    const auto& mine = layout.rows[at(e)];
    std::vector<int> tokens;
    for (int ch : mine) tokens.push_back(ch / c.k);
    runs.push_back(expert_forward(gather_rows(x, index_of(tokens, Memory::host)), all.w1[at(e)],
                                  all.w2[at(e)]));
    const auto count = static_cast<std::int64_t>(mine.size());
    if (count) outs.slice(offset, count).copy_from(runs.back().out);
    offset += count;
  }
  out.y = combine(x, r, 0, layout.row, outs);
  out.outs = outs;
  if (!dy.defined()) return out;
  // Backward: each expert from gate * dy of its rows.
  const std::vector<float> dgate = gate_grads(dy, r, 0, layout.row, outs);
  Tensor dins(layout.kept, c.hidden);
  offset = 0;
  for (int e = 0; e < c.experts; ++e) {
    const auto& mine = layout.rows[at(e)];
    const auto count = static_cast<std::int64_t>(mine.size());
    Tensor dout(count, c.hidden);
    for (std::int64_t i = 0; i < count; ++i)
      for (std::int64_t d = 0; d < c.hidden; ++d)
        dout(i, d) =
            r.gate[at(mine[at(static_cast<int>(i))])] * dy(mine[at(static_cast<int>(i))] / c.k, d);
    Tensor dw1, dw2;
    const Tensor dxe = expert_backward(runs[at(e)], dout, all.w1[at(e)], all.w2[at(e)], dw1, dw2);
    out.dw1.push_back(dw1);
    out.dw2.push_back(dw2);
    if (count) dins.slice(offset, count).copy_from(dxe);
    offset += count;
  }
  // The router: each rank's tokens with that rank's f.
  out.dlogits = Tensor(c.tokens, c.experts);
  for (int q = 0; q < ranks; ++q) {
    const ShardRange& sh = shards[at(q)];
    if (sh.length == 0) continue;
    out.dlogits.slice(sh.offset, sh.length)
        .copy_from(router_grad(c, r, sh.offset, probs.slice(sh.offset, sh.length), dgate,
                               first_choice_fractions(out.routings[at(q)])));
  }
  out.drouter = matmul(x, out.dlogits, true, false);
  out.dx = input_grad(dy, r, 0, layout.row, dins, out.dlogits, all.router);
  return out;
}

namespace {
/// |t|, element by element (host, f32).
Tensor magnitude(const Tensor& t) {
  Tensor m = t.to(Memory::host).clone();
  for (float& v : m) v = std::fabs(v);
  return m;
}
/// Componentwise, for C = A B computed from A' and B' within ea and eb of A and B (element
/// by element, matrices; undefined: 0) with the sums in any order: |C' - C| is at most
/// 2 gamma_K |A||B| (Higham §3.1, matmul_reorder_bound's, element by element) + ea |B| +
/// |A| eb, to first order.
Tensor carried(const Tensor& a, const Tensor& ea, const Tensor& b, const Tensor& eb) {
  constexpr double u = 0x1.0p-24;
  const double K = static_cast<double>(a.cols());
  const Tensor abs_a = magnitude(a), abs_b = magnitude(b);
  Tensor e = scale(matmul(abs_a, abs_b), static_cast<float>(2 * K * u / (1 - K * u)));
  if (ea.defined()) axpy(1.0f, matmul(ea, abs_b), e);
  if (eb.defined()) axpy(1.0f, matmul(abs_a, eb), e);
  return e;
}
}  // namespace

Tolerance tolerance(const MoeConfig& c, const Weights& all, const Tensor& x, const Tensor& dy,
                    const Result& ref, bool gpu) {
  Tolerance t;
  // The ranks sum the router's gradient in parts: another order of its T token terms.
  t.drouter = matmul_reorder_bound(transpose(x), ref.dlogits);
  if (!gpu) return t;
  constexpr float u = 0x1.0p-24f;
  const Routing r = concatenated(ref.routings);
  const Layout layout = layout_of(ref.routings);
  const auto& rows = layout.rows;
  const std::vector<int>& row = layout.row;
  const Tensor& outs = ref.outs;
  const Tensor probs = router_probs(x, all.router);
  // The experts, as the reference runs them, with their error matrices on a GPU: h = X W1,
  // a = tanh(h) (|tanh'| <= 1; tanhf within 2 ulp of |a| <= 1: 2^-22), o = a W2; backward
  // from do = gate dy: da = do W2^T, dh = da (1 - a^2) (|d dh/da| = 2 |a da|), dx_e = dh W1^T,
  // dW1 = X^T dh, dW2 = a^T do.
  Tensor e_outs(outs.rows(), c.hidden), e_dins(outs.rows(), c.hidden);
  // The router and the gates: z = x Wr; the softmax moves p_i by at most
  // p_i (ez_i + sum_j p_j ez_j); a gate p_j / S (S the chosen p's sum) by g_j (dp_j / p_j +
  // dS / S).
  const Tensor ez = carried(x, Tensor(), all.router, Tensor());
  Tensor ep(c.tokens, c.experts);
  std::vector<float> eg(at(c.tokens * c.k), 0.0f), es(at(c.tokens), 0.0f);
  for (int tk = 0; tk < c.tokens; ++tk) {
    float mean = 0, chosen = 0;
    for (int e = 0; e < c.experts; ++e) mean += probs(tk, e) * ez(tk, e);
    for (int e = 0; e < c.experts; ++e) ep(tk, e) = probs(tk, e) * (ez(tk, e) + mean);
    for (int j = 0; j < c.k; ++j) {
      const int e = r.expert[at(r.at(tk, j))];
      chosen += probs(tk, e), es[at(tk)] += ep(tk, e);
    }
    for (int j = 0; j < c.k; ++j) {
      const Index ch = at(r.at(tk, j));
      const int e = r.expert[ch];
      eg[ch] = c.k == 1 ? ep(tk, e) : r.gate[ch] * (ep(tk, e) / probs(tk, e) + es[at(tk)] / chosen);
    }
  }
  for (int e = 0; e < c.experts; ++e) {
    const auto& mine = rows[at(e)];
    if (mine.empty()) continue;
    const auto count = static_cast<std::int64_t>(mine.size());
    std::vector<int> tokens;
    Tensor dout(count, c.hidden), e_dout(count, c.hidden);
    for (std::int64_t i = 0; i < count; ++i) {
      const Index ch = at(mine[at(static_cast<int>(i))]);
      tokens.push_back(static_cast<int>(ch) / c.k);
      for (std::int64_t d = 0; d < c.hidden; ++d) {
        dout(i, d) = r.gate[ch] * dy(tokens.back(), d);
        e_dout(i, d) = eg[ch] * std::fabs(dy(tokens.back(), d)) + u * std::fabs(dout(i, d));
      }
    }
    const Tensor X = gather_rows(x, index_of(tokens, Memory::host));
    const Tensor &w1 = all.w1[at(e)], &w2 = all.w2[at(e)];
    const Tensor a = tanh(matmul(X, w1));
    const std::int64_t first = row[at(mine[0])];
    Tensor ea = carried(X, Tensor(), w1, Tensor());
    for (float& v : ea) v += 0x1.0p-22f;
    e_outs.slice(first, count).copy_from(carried(a, ea, w2, Tensor()));
    const Tensor da = matmul(dout, w2, false, true), dh = tanh_backward(a, da);
    Tensor edh = carried(dout, e_dout, transpose(w2), Tensor());
    for (std::int64_t i = 0; i < edh.size(); ++i)
      edh[i] += 2 * std::fabs(a[i] * da[i]) * ea[i] + 2 * u * std::fabs(dh[i]);
    e_dins.slice(first, count).copy_from(carried(dh, edh, transpose(w1), Tensor()));
    t.dw = std::max({t.dw, max_abs(carried(transpose(X), Tensor(), dh, edh)),
                     max_abs(carried(transpose(a), transpose(ea), dout, e_dout))});
  }
  // dL/dgate = dy . o; dL/dp through the renormalisation (dp_i = dg_i / S - W / S^2, W =
  // sum_j dg_j p_j, plus the aux loss's constant); dL/dz = p (dp - p . dp).
  const std::vector<float> dgate = gate_grads(dy, r, 0, row, outs);
  const Tensor& dlogits = ref.dlogits;
  const double hu = c.hidden * double{u}, gamma_d = hu / (1 - hu);
  std::vector<float> edg(at(c.tokens * c.k), 0.0f);
  Tensor edl(c.tokens, c.experts);
  for (int tk = 0; tk < c.tokens; ++tk) {
    std::vector<float> dp(at(c.experts), 0.0f), edp(at(c.experts), 0.0f);
    float S = 0, W = 0, eW = 0;
    for (int j = 0; j < c.k; ++j) {
      const Index ch = at(r.at(tk, j));
      if (row[ch] < 0) continue;
      float err = 0, mag = 0;
      for (std::int64_t d = 0; d < c.hidden; ++d) {
        err += std::fabs(dy(tk, d)) * e_outs(row[ch], d);
        mag += std::fabs(dy(tk, d) * outs(row[ch], d));
      }
      edg[ch] = err + static_cast<float>(2 * gamma_d) * mag;
    }
    for (int j = 0; j < c.k; ++j) {
      const Index ch = at(r.at(tk, j));
      const float p = probs(tk, r.expert[ch]);
      S += p, W += dgate[ch] * p, eW += edg[ch] * p + std::fabs(dgate[ch]) * ep(tk, r.expert[ch]);
    }
    for (int j = 0; j < c.k; ++j) {
      const Index ch = at(r.at(tk, j));
      const auto e = at(r.expert[ch]);
      dp[e] += c.k == 1 ? dgate[ch] : dgate[ch] / S - W / (S * S);
      edp[e] += c.k == 1 ? edg[ch]
                         : edg[ch] / S + std::fabs(dgate[ch]) * es[at(tk)] / (S * S) +
                               eW / (S * S) + 2 * std::fabs(W) * es[at(tk)] / (S * S * S);
    }
    float dot = 0, edot = 0;
    for (int e = 0; e < c.experts; ++e) {
      dot += probs(tk, e) * dp[at(e)];
      edot += ep(tk, e) * std::fabs(dp[at(e)]) + probs(tk, e) * edp[at(e)];
    }
    for (int e = 0; e < c.experts; ++e)
      edl(tk, e) = ep(tk, e) * std::fabs(dp[at(e)] - dot) + probs(tk, e) * (edp[at(e)] + edot) +
                   4 * u * std::fabs(dlogits(tk, e));
  }
  // y = x + the k choices' gate o; dx = dy + the k choices' dx_e + dlogits Wr^T; each
  // addition rounded (an ulp of the result).
  Tensor ey(c.tokens, c.hidden), edx = carried(dlogits, edl, transpose(all.router), Tensor());
  for (int tk = 0; tk < c.tokens; ++tk)
    for (int j = 0; j < c.k; ++j) {
      const Index ch = at(r.at(tk, j));
      if (row[ch] < 0) continue;
      for (std::int64_t d = 0; d < c.hidden; ++d) {
        ey(tk, d) += r.gate[ch] * e_outs(row[ch], d) + eg[ch] * std::fabs(outs(row[ch], d));
        edx(tk, d) += e_dins(row[ch], d);
      }
    }
  const double k = c.k;
  t.y = max_abs(ey) + 2 * k * u * max_abs(ref.y);
  t.dx = max_abs(edx) + 2 * (k + 1) * u * max_abs(ref.dx);
  t.drouter = max_abs(carried(transpose(x), Tensor(), dlogits, edl));
  return t;
}

// ---------------------------------------------------------------------------
// MoeLayer

namespace {

// The layer's Saved tensors, by position (children: one Saved per local expert).
enum SavedAt : Index {
  saved_x,                       // this rank's tokens, in the layer's memory
  saved_probs,                   // its tokens' router probabilities, T_r x E (host)
  saved_expert,                  // its routing, T_r k each (host): i32
  saved_gate,                    //   f32
  saved_slot,                    //   i32
  saved_send_order,              // the dispatch plan (host): i32
  saved_per_expert,              //   i64, rows to each expert
  saved_send_counts,             //   i64, rows to each rank
  saved_received,                //   i64, the counts the exchange brought (N x E/N)
  saved_returned,                // the experts' outputs back at this rank, in send order
  forward_saved,                 // how many the forward keeps;
  saved_dlogits = forward_saved  // backward_input adds dL/dlogits of this rank's tokens
};

template <class T, class From>
Tensor as_tensor(const std::vector<From>& v) {
  return Tensor::from_vector(std::vector<T>(v.begin(), v.end()));
}
template <class To, class T>
std::vector<To> as_vector(const Tensor& t) {
  const std::span<const T> s = t.span<T>();
  return std::vector<To>(s.begin(), s.end());
}

Routing routing_of(const MoeConfig& c, const nn::Saved& s, int capacity) {
  Routing r{0,
            c.experts,
            c.k,
            capacity,
            as_vector<int, std::int32_t>(s.tensors.at(saved_expert)),
            as_vector<float, float>(s.tensors.at(saved_gate)),
            as_vector<int, std::int32_t>(s.tensors.at(saved_slot))};
  r.tokens = static_cast<int>(r.expert.size()) / c.k;
  return r;
}
Dispatch plan_of(const nn::Saved& s) {
  return Dispatch{as_vector<std::size_t, std::int64_t>(s.tensors.at(saved_per_expert)),
                  as_vector<std::size_t, std::int64_t>(s.tensors.at(saved_send_counts)),
                  as_vector<int, std::int32_t>(s.tensors.at(saved_send_order))};
}

/// Where every row is on this rank: each of its choices' row in the send buffer (send
/// order; -1 dropped), the token of each row sent (a row of this rank's x), each local
/// expert's rows in the receive buffer (plan_arrivals), and the counts x d.
struct Places {
  std::vector<int> send_row, send_tokens;
  std::vector<Tensor> expert_rows;
  std::vector<std::size_t> send_elems, recv_elems;
};
/// Checks of the two plans (the exercise's), so that a wrong one is named
/// here and not found later as a bad row index inside gather_rows.
void check_plans(const Routing& r, const Dispatch& plan, const Arrivals& arrivals,
                 const std::vector<std::int64_t>& received, int rank, int ranks) {
  const std::string who = "rank " + std::to_string(rank) + ": ";
  const auto E = static_cast<std::size_t>(r.experts), per = E / static_cast<std::size_t>(ranks);
  require(plan.per_expert.size() == E && plan.send_counts.size() == static_cast<std::size_t>(ranks),
          [&] {
            return who + "plan_dispatch gave " + std::to_string(plan.per_expert.size()) +
                   " counts per expert and " + std::to_string(plan.send_counts.size()) +
                   " per rank, for " + std::to_string(E) + " experts on " + std::to_string(ranks) +
                   " ranks";
          });
  std::vector<int> seen(at(r.tokens * r.k), 0);
  for (int c : plan.send_order) {
    require(c >= 0 && c < r.tokens * r.k && r.slot[at(c)] >= 0 && seen[at(c)]++ == 0, [&] {
      return who + "plan_dispatch sends choice " + std::to_string(c) +
             (c < 0 || c >= r.tokens * r.k ? ", which does not exist"
              : r.slot[at(c)] < 0          ? ", which was dropped"
                                           : " twice");
    });
  }
  std::size_t kept = 0, by_expert = 0, by_rank = 0;
  for (std::size_t c = 0; c < seen.size(); ++c) kept += r.slot[c] >= 0;
  for (std::size_t e = 0; e < E; ++e) by_expert += plan.per_expert[e];
  for (std::size_t q = 0; q < static_cast<std::size_t>(ranks); ++q) {
    std::size_t experts = 0;
    for (std::size_t l = 0; l < per; ++l) experts += plan.per_expert[q * per + l];
    require(plan.send_counts[q] == experts, [&] {
      return who + "plan_dispatch sends " + std::to_string(plan.send_counts[q]) + " rows to rank " +
             std::to_string(q) + ", but counts " + std::to_string(experts) + " for its experts";
    });
    by_rank += plan.send_counts[q];
  }
  require(plan.send_order.size() == kept && by_expert == kept && by_rank == kept, [&] {
    return who + "plan_dispatch sends " + std::to_string(plan.send_order.size()) +
           " choices and counts " + std::to_string(by_expert) + ", but the routing kept " +
           std::to_string(kept);
  });
  std::size_t coming = 0;
  for (std::int64_t n : received) coming += static_cast<std::size_t>(n);
  std::size_t told = 0;
  for (std::size_t n : arrivals.recv_counts) told += n;
  require(arrivals.recv_counts.size() == static_cast<std::size_t>(ranks) && told == coming &&
              arrivals.expert_rows.size() == per,
          [&] {
            return who + "plan_arrivals expects " + std::to_string(told) + " rows from " +
                   std::to_string(arrivals.recv_counts.size()) + " ranks for " +
                   std::to_string(arrivals.expert_rows.size()) + " experts; the counts say " +
                   std::to_string(coming) + " rows from " + std::to_string(ranks) + " ranks for " +
                   std::to_string(per);
          });
  std::vector<int> used(coming, 0);
  for (std::size_t l = 0; l < per; ++l)
    for (int row : arrivals.expert_rows[l])
      require(row >= 0 && static_cast<std::size_t>(row) < coming && used[at(row)]++ == 0, [&] {
        return who + "plan_arrivals gives local expert " + std::to_string(l) + " row " +
               std::to_string(row) +
               (row < 0 || static_cast<std::size_t>(row) >= coming
                    ? " of a receive buffer of " + std::to_string(coming)
                    : ", which another expert takes too");
      });
}

Places places_of(const MoeConfig& c, const Routing& r, const Dispatch& plan,
                 const Arrivals& arrivals, Memory memory) {
  Places p;
  p.send_row.assign(at(r.tokens * c.k), -1);
  for (std::size_t i = 0; i < plan.send_order.size(); ++i) {
    p.send_row[at(plan.send_order[i])] = static_cast<int>(i);
    p.send_tokens.push_back(plan.send_order[i] / c.k);
  }
  for (const std::vector<int>& rows : arrivals.expert_rows)
    p.expert_rows.push_back(index_of(rows, memory));
  for (auto n : plan.send_counts) p.send_elems.push_back(n * static_cast<std::size_t>(c.hidden));
  for (auto n : arrivals.recv_counts)
    p.recv_elems.push_back(n * static_cast<std::size_t>(c.hidden));
  return p;
}

}  // namespace

MoeLayer::MoeLayer(nn::ParameterStore& store, Communicator& comm, const MoeConfig& config,
                   const std::string& name)
    : MoeLayer(store, comm, config,
               make_weights(config, comm.rank() * (config.experts / comm.size()),
                            config.experts / comm.size()),
               name) {}

MoeLayer::MoeLayer(nn::ParameterStore& store, Communicator& comm, const MoeConfig& config,
                   const Weights& init, const std::string& name)
    : comm_(comm), config_(config), name_(name) {
  const int N = comm.size(), per = config.experts / N;
  first_ = comm.rank() * per;
  require(config.experts % N == 0 && static_cast<int>(init.w1.size()) == per &&
              init.w2.size() == init.w1.size() && init.first == first_ && init.router.ndim() == 2 &&
              init.router.rows() == config.hidden && init.router.cols() == config.experts,
          [&] {
            return name + ": " + std::to_string(config.experts) + " experts over " +
                   std::to_string(N) + " ranks; rank " + std::to_string(comm.rank()) +
                   " was given " + std::to_string(init.w1.size()) + " from expert " +
                   std::to_string(init.first) + " and a router " + init.router.describe();
          });
  const std::int64_t d = config.hidden, h = config.ffn;
  router_ = &store.add(name + ".router", init.router.clone());
  for (int l = 0; l < per; ++l) {
    // Expert e: Linear d -> h, tanh, Linear h -> d, no biases; the weights of `init`.
    const int e = first_ + l;
    const std::string prefix = name + ".expert" + std::to_string(e);
    auto net = std::make_shared<nn::Sequential>();
    net->add<nn::Linear>(store, prefix + ".w1", d, h, expert_seed(config, e), false)
        .weight()
        .value.copy_from(init.w1[at(l)]);
    net->add<nn::Tanh>();
    net->add<nn::Linear>(store, prefix + ".w2", h, d, expert_seed(config, e) + 1, false)
        .weight()
        .value.copy_from(init.w2[at(l)]);
    experts_.push_back(std::move(net));
  }
}

nn::Parameter& MoeLayer::w1(int l) {
  return dynamic_cast<nn::Linear&>((*experts_.at(at(l)))[0]).weight();
}
nn::Parameter& MoeLayer::w2(int l) {
  return dynamic_cast<nn::Linear&>((*experts_.at(at(l)))[2]).weight();
}

std::vector<nn::Parameter*> MoeLayer::parameters() const {
  std::vector<nn::Parameter*> out = {router_};
  for (const auto& net : experts_)
    for (nn::Parameter* p : net->parameters()) out.push_back(p);
  return out;
}

Weights MoeLayer::weights() const {
  Weights w;
  w.first = first_;
  w.router = router_->value.to(Memory::host).clone();
  for (const auto& net : experts_) {
    const auto params = net->parameters();  // W1, W2
    w.w1.push_back(params.at(0)->value.to(Memory::host).clone());
    w.w2.push_back(params.at(1)->value.to(Memory::host).clone());
  }
  return w;
}

Routing MoeLayer::routing(const nn::Saved& saved) const {
  require(saved.tensors.size() >= forward_saved,
          [&] { return name_ + ": the routing of a Saved that is not this layer's forward's"; });
  return routing_of(config_, saved, config_.capacity(comm_.rank(), comm_.size()));
}

RoutingStats MoeLayer::stats(const nn::Saved& saved) const {
  return routing_stats(config_, routing(saved), saved.tensors.at(saved_probs));
}

nn::Forward MoeLayer::forward(const Tensor& x_in) const {
  const MoeConfig& c = config_;
  const int N = comm_.size(), rank = comm_.rank();
  const ShardRange tokens = shard_range(c.tokens, N, rank);
  require(x_in.ndim() == 2 && x_in.rows() == tokens.length && x_in.cols() == c.hidden, [&] {
    return name_ + ": rank " + std::to_string(rank) + " has x " + x_in.describe() +
           "; shard_range gives it " + std::to_string(tokens.length) + " of the " +
           std::to_string(c.tokens) + " tokens, " + std::to_string(c.hidden) + " wide";
  });
  const Memory memory = router_->value.memory();
  const Tensor x = x_in.to(memory);
  const std::int64_t d = c.hidden;
  // 1. Route this rank's tokens, with a capacity from their number.
  const Tensor probs = router_probs(x, router_->value);
  const Routing r = route(probs, c.k, c.capacity(rank, N));
  const Dispatch plan = plan_dispatch(r, N);
  // 2. The exchange of counts: rank q learns how many rows each of its experts gets from
  // this rank (E/N counts each way between every pair).
  const std::vector<std::int64_t> per_expert(plan.per_expert.begin(), plan.per_expert.end());
  std::vector<std::int64_t> received(per_expert.size());
  comm_.alltoall(per_expert, received);
  const Arrivals arrivals =
      plan_arrivals(std::vector<std::size_t>(received.begin(), received.end()), N);
  check_plans(r, plan, arrivals, received, rank, N);
  const Places p = places_of(c, r, plan, arrivals, memory);
  const auto n_send = static_cast<std::int64_t>(plan.send_order.size());
  std::int64_t n_recv = 0;
  for (std::size_t n : arrivals.recv_counts) n_recv += static_cast<std::int64_t>(n);
  // 3. Dispatch: this rank's token rows, in send order, to their experts' ranks.
  const Tensor send = gather_rows(x, index_of(p.send_tokens, memory));
  Tensor recv(Shape{n_recv, d}, DType::f32, memory);
  comm_.alltoallv(send, p.send_elems, recv, p.recv_elems);
  // 4. Each local expert runs its rows: by source rank, then slot (as on one device).
  nn::Forward f;
  Tensor outs(Shape{n_recv, d}, DType::f32, memory);
  for (std::size_t l = 0; l < experts_.size(); ++l) {
    nn::Forward e = experts_[l]->forward(gather_rows(recv, p.expert_rows[l]));
    if (e.out.rows()) scatter_add_rows(outs, p.expert_rows[l], e.out);
    f.saved.children.push_back(std::move(e.saved));
  }
  // 5. Combine: the outputs go back the way they came; y = x + gate x output.
  Tensor back(Shape{n_send, d}, DType::f32, memory);
  comm_.alltoallv(outs, p.recv_elems, back, p.send_elems);
  f.out = combine(x, r, 0, p.send_row, back).to(memory);
  f.saved.tensors = {x,
                     probs,
                     as_tensor<std::int32_t>(r.expert),
                     as_tensor<float>(r.gate),
                     as_tensor<std::int32_t>(r.slot),
                     as_tensor<std::int32_t>(plan.send_order),
                     as_tensor<std::int64_t>(plan.per_expert),
                     as_tensor<std::int64_t>(plan.send_counts),
                     as_tensor<std::int64_t>(received),
                     back};
  return f;
}

Tensor MoeLayer::backward_input(const Tensor& dy_in, nn::Saved& saved) const {
  const MoeConfig& c = config_;
  const int N = comm_.size(), per = experts_here();
  require(saved.tensors.size() == forward_saved && saved.children.size() == at(per), [&] {
    return name_ + " backward: a Saved from this layer's forward (" +
           std::to_string(saved.tensors.size()) + " tensors), before any backward_input";
  });
  const Tensor& x = saved.tensors[saved_x];
  require(dy_in.same_shape(x),
          [&] { return name_ + " backward: dy is " + dy_in.describe() + ", x " + x.describe(); });
  const Memory memory = router_->value.memory();
  const Routing r = routing(saved);
  const Dispatch plan = plan_of(saved);
  const Arrivals arrivals =
      plan_arrivals(as_vector<std::size_t, std::int64_t>(saved.tensors[saved_received]), N);
  const Places p = places_of(c, r, plan, arrivals, memory);
  const auto n_send = static_cast<std::int64_t>(plan.send_order.size());
  std::int64_t n_recv = 0;
  for (std::size_t n : arrivals.recv_counts) n_recv += static_cast<std::int64_t>(n);
  const std::int64_t d = c.hidden;
  // A rank may hold no tokens (T < N): it still joins every all-to-all.
  // 1. gate x dy to the experts, the way the tokens went.
  const Tensor dy = dy_in.to(Memory::host);
  const std::vector<float> dgate = gate_grads(dy, r, 0, p.send_row, saved.tensors[saved_returned]);
  Tensor scaled(n_send, d);
  for (std::int64_t i = 0; i < n_send; ++i) {
    const float g = r.gate[at(plan.send_order[at(static_cast<int>(i))])];
    const std::int64_t t = p.send_tokens[at(static_cast<int>(i))];
    for (std::int64_t e = 0; e < d; ++e) scaled(i, e) = g * dy(t, e);
  }
  Tensor grads(Shape{n_recv, d}, DType::f32, memory);
  comm_.alltoallv(scaled.to(memory), p.send_elems, grads, p.recv_elems);
  // 2. Each local expert's B; their dL/dx rows go back.
  Tensor dins_recv(Shape{n_recv, d}, DType::f32, memory);
  for (int l = 0; l < per; ++l) {
    const Tensor dxe = experts_[at(l)]->backward_input(gather_rows(grads, p.expert_rows[at(l)]),
                                                       saved.children[at(l)]);
    if (dxe.rows()) scatter_add_rows(dins_recv, p.expert_rows[at(l)], dxe);
  }
  Tensor dins(Shape{n_send, d}, DType::f32, memory);
  comm_.alltoallv(dins_recv, p.recv_elems, dins, p.send_elems);
  // 3. Through the router (gates and this rank's aux loss), and the residual.
  const Tensor dlogits =
      router_grad(c, r, 0, saved.tensors[saved_probs], dgate, first_choice_fractions(r));
  saved.dy = dy_in;
  saved.tensors.push_back(dlogits);
  return input_grad(dy, r, 0, p.send_row, dins, dlogits, router_->value).to(memory);
}

double MoeLayer::expert_grad_diff(const Result& reference) {
  double diff = 0;
  for (int l = 0; l < experts_here(); ++l) {
    const auto e = static_cast<std::size_t>(first_ + l);
    diff = std::max({diff, max_abs_diff(w1(l).grad.to(Memory::host), reference.dw1[e]),
                     max_abs_diff(w2(l).grad.to(Memory::host), reference.dw2[e])});
  }
  return diff;
}

void MoeLayer::backward_weight(nn::Saved& saved) {
  require(
      saved.tensors.size() == forward_saved + 1 && saved.dy.defined() &&
          saved.children.size() == experts_.size(),
      [&] { return name_ + ": backward_weight needs backward_input first (or was called twice)"; });
  for (std::size_t l = 0; l < experts_.size(); ++l) experts_[l]->backward_weight(saved.children[l]);
  // The router is every rank's: its gradient is the sum over every rank's tokens.
  Tensor drouter =
      matmul(saved.tensors[saved_x].to(Memory::host), saved.tensors[saved_dlogits], true, false);
  comm_.allreduce(drouter, ReduceOp::sum);
  axpy(1.0f, drouter.to(router_->grad.memory()), router_->grad);
  saved = nn::Saved{};
}

Result moe_parallel(Communicator& comm, const MoeConfig& config, const Weights& mine,
                    const Tensor& x, const Tensor& dy, Memory memory) {
  nn::ParameterStore store;
  MoeLayer layer(store, comm, config, mine);
  store.allocate(memory);
  const CommStats before = comm.stats();
  nn::Forward f = layer.forward(x);
  Result out;
  out.y = f.out.to(Memory::host);
  out.routings = {layer.routing(f.saved)};
  out.stats = combined(comm, layer.stats(f.saved));
  if (dy.defined()) {
    out.dx = layer.backward(dy, f.saved).to(Memory::host);
    auto host = [](const nn::Parameter& p) { return p.grad.to(Memory::host).clone(); };
    out.drouter = host(layer.router());
    for (int l = 0; l < layer.experts_here(); ++l) {
      out.dw1.push_back(host(layer.w1(l)));
      out.dw2.push_back(host(layer.w2(l)));
    }
  }
  const CommStats moved = comm.stats().since(before);
  out.alltoall_received = moved[Op::alltoall].bytes_received;
  out.traffic_modeled = moved.is_modeled(Op::alltoall);
  return out;
}

// ---------------------------------------------------------------------------
// What the all-to-alls move

std::uint64_t formula_alltoall_bytes(const std::vector<Routing>& routings, int rank, int ranks,
                                     int hidden) {
  const int per = routings.front().experts / ranks;
  std::uint64_t rows = 0;
  for (int q = 0; q < ranks; ++q) {
    const Routing& r = routings[at(q)];
    for (int c = 0; c < r.tokens * r.k; ++c) {
      if (r.slot[at(c)] < 0) continue;  // dropped: travels nowhere
      const int owner = r.expert[at(c)] / per;
      // Rank q's token to another rank's expert: received by that rank in the dispatch
      // and by q in the combine.
      if (owner != q && (owner == rank || q == rank)) ++rows;
    }
  }
  const auto counts = static_cast<std::uint64_t>((ranks - 1) * per) * 8;
  return 2 * rows * static_cast<std::uint64_t>(hidden) * 4 + counts;
}

double even_router_alltoall_bytes(const MoeConfig& c, int ranks) {
  const double N = ranks;
  return 4.0 * c.k * (c.tokens / N) * (N - 1.0) / N * c.hidden * 4 +
         (N - 1.0) * (c.experts / N) * 8;
}

void pairwise_alltoallv(Communicator& comm, const Tensor& in,
                        std::span<const std::size_t> send_counts, Tensor& out,
                        std::span<const std::size_t> recv_counts) {
  const int N = comm.size(), r = comm.rank();
  auto offsets = [&](std::span<const std::size_t> counts) {
    std::vector<std::int64_t> o(at(N + 1), 0);
    for (std::size_t q = 0; q < counts.size() && q < at(N); ++q)
      o[q + 1] = o[q] + static_cast<std::int64_t>(counts[q]);
    return o;
  };
  const std::vector<std::int64_t> send_at = offsets(send_counts), recv_at = offsets(recv_counts);
  require(send_counts.size() == at(N) && recv_counts.size() == at(N) &&
              send_at.back() == in.size() && recv_at.back() == out.size() &&
              send_counts[at(r)] == recv_counts[at(r)],
          [&] {
            return "pairwise_alltoallv on rank " + std::to_string(r) + " of " + std::to_string(N) +
                   ": counts for " + std::to_string(send_counts.size()) + " and " +
                   std::to_string(recv_counts.size()) + " ranks, summing to " +
                   std::to_string(send_at.back()) + " and " + std::to_string(recv_at.back()) +
                   ", for " + in.describe() + " in and " + out.describe() + " out";
          });
  const Tensor src = in.flat();
  Tensor dst = out.flat();
  auto block = [](const Tensor& t, const std::vector<std::int64_t>& starts, int q) {
    return t.slice(starts[at(q)], starts[at(q + 1)] - starts[at(q)]);
  };
  block(dst, recv_at, r).copy_from(block(src, send_at, r));
  // Step s: send to rank r + s, receive from r - s; every rank pairs up with two others.
  for (int s = 1; s < N; ++s) {
    const int to = (r + s) % N, from = (r - s + N) % N;
    Tensor into = block(dst, recv_at, from);
    comm.sendrecv(block(src, send_at, to), to, into, from, 70 + s);
  }
}

std::vector<bench::Case> alltoall_cases(Communicator& comm, Memory memory) {
  struct Buffers {
    Tensor in, out;
    std::vector<std::size_t> counts;  // elements per peer
  };
  auto b = std::make_shared<Buffers>();
  const int N = comm.size(), r = comm.rank();
  auto prepare = [b, N, r, memory](std::int64_t count) {
    const std::int64_t block = count / N;
    b->counts.assign(at(N), static_cast<std::size_t>(block));
    Tensor h(block * N);
    for (std::int64_t i = 0; i < h.size(); ++i) h[i] = static_cast<float>(r * 1000003 + i);
    b->in = h.to(memory);
    b->out = Tensor(h.shape(), DType::f32, memory);
  };
  auto wrong_after = [b, N, r](const std::function<void()>& exchange) {
    b->out.zero();
    exchange();
    const Tensor got = b->out.to(Memory::host);
    const std::int64_t block = got.size() / N;
    std::uint64_t bad = 0;
    for (int q = 0; q < N; ++q)
      for (std::int64_t i = 0; i < block; ++i)
        bad += got[q * block + i] != static_cast<float>(q * 1000003 + r * block + i);
    return bad;
  };
  std::function<void()> native = [b, &comm] { comm.alltoall(b->in, b->out); };
  std::function<void()> pairwise = [b, &comm] {
    pairwise_alltoallv(comm, b->in, b->counts, b->out, b->counts);
  };
  const double bus = (N - 1.0) / N;
  return {{std::string(comm.backend()) + "_alltoall", prepare, native,
           [=] { return wrong_after(native); }, bus},
          {"pairwise", prepare, pairwise, [=] { return wrong_after(pairwise); }, bus}};
}

// ---------------------------------------------------------------------------
// Training the router

namespace {
/// The direction every training token leans along (unit length).
Tensor lean(const MoeConfig& c) {
  return scale(full(Shape{c.hidden}, 1.0f), 1.0f / std::sqrt(static_cast<float>(c.hidden)));
}
}  // namespace

Batch leaning_batch(const MoeConfig& c, std::uint64_t step) {
  const Tensor u = lean(c);
  const float root_d = std::sqrt(static_cast<float>(c.hidden));
  Tensor x = randn(Shape{c.tokens, c.hidden}, c.seed * 7919 + 1000 + step);
  for (std::int64_t t = 0; t < c.tokens; ++t)
    for (std::int64_t i = 0; i < c.hidden; ++i) x(t, i) += 1.5f * u[i] * root_d;
  const Tensor A = scale(randn(Shape{c.hidden, c.hidden}, c.seed * 7919 + 21),
                         1.0f / std::sqrt(static_cast<float>(c.hidden)));
  return {x, add(x, scale(tanh(matmul(x, A)), 0.5f))};
}

TrainRun train(Communicator& comm, const MoeConfig& c, const TrainSettings& s) {
  const int N = comm.size(), per = c.experts / N;
  Weights init = make_weights(c, comm.rank() * per, per);
  const Tensor u = lean(c);
  for (std::int64_t i = 0; i < c.hidden; ++i) init.router(i, 0) += 2.0f * u[i];
  nn::ParameterStore store;
  MoeLayer layer(store, comm, c, init);
  store.allocate(s.memory);
  nn::Adam adam(store.size(), {.lr = s.lr}, s.memory);
  const ShardRange mine = shard_range(c.tokens, N, comm.rank());
  TrainRun run;
  for (int step = 1; step <= s.steps; ++step) {
    // A fresh batch each step; this rank's share of it.
    const Batch batch = leaning_batch(c, static_cast<std::uint64_t>(step));
    const Tensor x = batch.x.slice(mine.offset, mine.length);
    const Tensor target = batch.target.slice(mine.offset, mine.length);
    nn::Forward f = layer.forward(x.to(s.memory));
    const RoutingStats stats = combined(comm, layer.stats(f.saved));
    const Tensor y = f.out.to(Memory::host);
    // L = sum over every rank's tokens of |y - target|^2 / 2T (+ the aux loss).
    run.loss.push_back(comm.agree(nn::squared_error(y, target), ReduceOp::sum) / (2.0 * c.tokens));
    run.kept.push_back(stats.kept);
    run.aux_loss.push_back(stats.aux_loss);
    run.dropped_fraction.push_back(static_cast<double>(stats.dropped) / (c.k * c.tokens));
    store.zero_grad();
    const Tensor dy = scale(sub(y, target), 1.0f / static_cast<float>(c.tokens));
    layer.backward(dy.to(s.memory), f.saved);
    adam.step(store.values(), store.grads());
  }
  run.weights = layer.weights();
  return run;
}

}  // namespace ch07

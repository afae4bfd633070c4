// Chapter 07's MoE layer on one device, written out: the router, the experts, the combine,
// and their backward (the reference every expert-parallel run is held to), its routing
// statistics, and the tolerance a GPU's run is held to. The layer whose tokens travel to
// their experts' ranks is moe_layer.cpp; what the all-to-alls move, alltoall.cpp; the
// router's training, train.cpp.
#include "moe.hpp"

#include <algorithm>
#include <cmath>

#include "combine.hpp"
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

namespace {}  // namespace

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
struct ExpertRows {
  std::vector<std::vector<int>> rows;
  std::vector<int> row;
  std::int64_t kept = 0;
};
ExpertRows expert_rows_of(const std::vector<Routing>& routings) {
  const int E = routings.front().experts, k = routings.front().k;
  ExpertRows l;
  l.rows.resize(idx(E));
  int first = 0;  // the rank's first choice in the whole batch
  for (const Routing& r : routings) {
    std::vector<std::vector<int>> by_slot(idx(E), std::vector<int>(idx(r.capacity), -1));
    for (int c = 0; c < r.tokens * k; ++c)
      if (r.slot[idx(c)] >= 0) by_slot[idx(r.expert[idx(c)])][idx(r.slot[idx(c)])] = first + c;
    for (int e = 0; e < E; ++e)
      for (int c : by_slot[idx(e)])
        if (c >= 0) l.rows[idx(e)].push_back(c);
    first += r.tokens * k;
  }
  l.row.assign(idx(first), -1);
  for (const auto& mine : l.rows)
    for (int c : mine) l.row[idx(c)] = static_cast<int>(l.kept++);
  return l;
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
  s.wanted.assign(idx(E), 0);
  s.kept.assign(idx(E), 0);
  for (int t = 0; t < r.tokens; ++t) {
    bool any = false;
    for (int j = 0; j < c.k; ++j) {
      const Index ch = idx(r.at(t, j));
      const Index e = idx(r.expert[ch]);
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
    aux += f[idx(e)] * (P / c.tokens);
  }
  s.aux_loss = c.aux_alpha * E * aux;
  return s;
}

RoutingStats combined(Communicator& comm, const RoutingStats& mine) {
  Communicator::Uncounted not_counted(comm);
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
  const ExpertRows layout = expert_rows_of(out.routings);
  // Each expert runs its rows, gathered straight from x: by source rank, then slot.
  Tensor outs(layout.kept, c.hidden);
  std::vector<ExpertRun> runs;
  std::int64_t offset = 0;
  for (int e = 0; e < c.experts; ++e) {
    const auto& mine = layout.rows[idx(e)];
    std::vector<int> tokens;
    for (int ch : mine) tokens.push_back(ch / c.k);
    runs.push_back(expert_forward(index_rows(x, index_of(tokens, Memory::host)), all.w1[idx(e)],
                                  all.w2[idx(e)]));
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
    const auto& mine = layout.rows[idx(e)];
    const auto count = static_cast<std::int64_t>(mine.size());
    Tensor dout(count, c.hidden);
    for (std::int64_t i = 0; i < count; ++i)
      for (std::int64_t d = 0; d < c.hidden; ++d)
        dout(i, d) = r.gate[idx(mine[idx(static_cast<int>(i))])] *
                     dy(mine[idx(static_cast<int>(i))] / c.k, d);
    Tensor dw1, dw2;
    const Tensor dxe =
        expert_backward(runs[idx(e)], dout, all.w1[idx(e)], all.w2[idx(e)], dw1, dw2);
    out.dw1.push_back(dw1);
    out.dw2.push_back(dw2);
    if (count) dins.slice(offset, count).copy_from(dxe);
    offset += count;
  }
  // The router: each rank's tokens with that rank's f.
  out.dlogits = Tensor(c.tokens, c.experts);
  for (int q = 0; q < ranks; ++q) {
    const ShardRange& sh = shards[idx(q)];
    if (sh.length == 0) continue;
    out.dlogits.slice(sh.offset, sh.length)
        .copy_from(router_grad(c, r, sh.offset, probs.slice(sh.offset, sh.length), dgate,
                               first_choice_fractions(out.routings[idx(q)])));
  }
  out.drouter = matmul(x, out.dlogits, true, false);
  out.dx = input_grad(dy, r, 0, layout.row, dins, out.dlogits, all.router);
  return out;
}

namespace {
/// |t|, element by element (host, f32).
Tensor absolute(const Tensor& t) {
  Tensor m = t.to(Memory::host).clone();
  for (float& v : m) v = std::fabs(v);
  return m;
}
/// Componentwise, for C = A B computed from A' and B' within ea and eb of A and B (element
/// by element, matrices; undefined: 0) with the sums in any order: |C' - C| is at most
/// 2 gamma_K |A||B| (Higham §3.1, matmul_reorder_bound's, element by element) + ea |B| +
/// |A| eb, to first order.
Tensor product_error_bound(const Tensor& a, const Tensor& ea, const Tensor& b, const Tensor& eb) {
  constexpr double u = 0x1.0p-24;
  const double K = static_cast<double>(a.cols());
  const Tensor abs_a = absolute(a), abs_b = absolute(b);
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
  const ExpertRows layout = expert_rows_of(ref.routings);
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
  const Tensor ez = product_error_bound(x, Tensor(), all.router, Tensor());
  Tensor ep(c.tokens, c.experts);
  std::vector<float> eg(idx(c.tokens * c.k), 0.0f), es(idx(c.tokens), 0.0f);
  for (int tk = 0; tk < c.tokens; ++tk) {
    float mean = 0, chosen = 0;
    for (int e = 0; e < c.experts; ++e) mean += probs(tk, e) * ez(tk, e);
    for (int e = 0; e < c.experts; ++e) ep(tk, e) = probs(tk, e) * (ez(tk, e) + mean);
    for (int j = 0; j < c.k; ++j) {
      const int e = r.expert[idx(r.at(tk, j))];
      chosen += probs(tk, e), es[idx(tk)] += ep(tk, e);
    }
    for (int j = 0; j < c.k; ++j) {
      const Index ch = idx(r.at(tk, j));
      const int e = r.expert[ch];
      eg[ch] =
          c.k == 1 ? ep(tk, e) : r.gate[ch] * (ep(tk, e) / probs(tk, e) + es[idx(tk)] / chosen);
    }
  }
  for (int e = 0; e < c.experts; ++e) {
    const auto& mine = rows[idx(e)];
    if (mine.empty()) continue;
    const auto count = static_cast<std::int64_t>(mine.size());
    std::vector<int> tokens;
    Tensor dout(count, c.hidden), e_dout(count, c.hidden);
    for (std::int64_t i = 0; i < count; ++i) {
      const Index ch = idx(mine[idx(static_cast<int>(i))]);
      tokens.push_back(static_cast<int>(ch) / c.k);
      for (std::int64_t d = 0; d < c.hidden; ++d) {
        dout(i, d) = r.gate[ch] * dy(tokens.back(), d);
        e_dout(i, d) = eg[ch] * std::fabs(dy(tokens.back(), d)) + u * std::fabs(dout(i, d));
      }
    }
    const Tensor X = index_rows(x, index_of(tokens, Memory::host));
    const Tensor &w1 = all.w1[idx(e)], &w2 = all.w2[idx(e)];
    const Tensor a = tanh(matmul(X, w1));
    const std::int64_t first = row[idx(mine[0])];
    Tensor ea = product_error_bound(X, Tensor(), w1, Tensor());
    for (float& v : ea) v += 0x1.0p-22f;
    e_outs.slice(first, count).copy_from(product_error_bound(a, ea, w2, Tensor()));
    const Tensor da = matmul(dout, w2, false, true), dh = tanh_backward(a, da);
    Tensor edh = product_error_bound(dout, e_dout, transpose(w2), Tensor());
    for (std::int64_t i = 0; i < edh.size(); ++i)
      edh[i] += 2 * std::fabs(a[i] * da[i]) * ea[i] + 2 * u * std::fabs(dh[i]);
    e_dins.slice(first, count).copy_from(product_error_bound(dh, edh, transpose(w1), Tensor()));
    t.dw = std::max({t.dw, max_abs(product_error_bound(transpose(X), Tensor(), dh, edh)),
                     max_abs(product_error_bound(transpose(a), transpose(ea), dout, e_dout))});
  }
  // dL/dgate = dy . o; dL/dp through the renormalisation (dp_i = dg_i / S - W / S^2, W =
  // sum_j dg_j p_j, plus the aux loss's constant); dL/dz = p (dp - p . dp).
  const std::vector<float> dgate = gate_grads(dy, r, 0, row, outs);
  const Tensor& dlogits = ref.dlogits;
  const double hu = c.hidden * double{u}, gamma_d = hu / (1 - hu);
  std::vector<float> edg(idx(c.tokens * c.k), 0.0f);
  Tensor edl(c.tokens, c.experts);
  for (int tk = 0; tk < c.tokens; ++tk) {
    std::vector<float> dp(idx(c.experts), 0.0f), edp(idx(c.experts), 0.0f);
    float S = 0, W = 0, eW = 0;
    for (int j = 0; j < c.k; ++j) {
      const Index ch = idx(r.at(tk, j));
      if (row[ch] < 0) continue;
      float err = 0, mag = 0;
      for (std::int64_t d = 0; d < c.hidden; ++d) {
        err += std::fabs(dy(tk, d)) * e_outs(row[ch], d);
        mag += std::fabs(dy(tk, d) * outs(row[ch], d));
      }
      edg[ch] = err + static_cast<float>(2 * gamma_d) * mag;
    }
    for (int j = 0; j < c.k; ++j) {
      const Index ch = idx(r.at(tk, j));
      const float p = probs(tk, r.expert[ch]);
      S += p, W += dgate[ch] * p, eW += edg[ch] * p + std::fabs(dgate[ch]) * ep(tk, r.expert[ch]);
    }
    for (int j = 0; j < c.k; ++j) {
      const Index ch = idx(r.at(tk, j));
      const auto e = idx(r.expert[ch]);
      dp[e] += c.k == 1 ? dgate[ch] : dgate[ch] / S - W / (S * S);
      edp[e] += c.k == 1 ? edg[ch]
                         : edg[ch] / S + std::fabs(dgate[ch]) * es[idx(tk)] / (S * S) +
                               eW / (S * S) + 2 * std::fabs(W) * es[idx(tk)] / (S * S * S);
    }
    float dot = 0, edot = 0;
    for (int e = 0; e < c.experts; ++e) {
      dot += probs(tk, e) * dp[idx(e)];
      edot += ep(tk, e) * std::fabs(dp[idx(e)]) + probs(tk, e) * edp[idx(e)];
    }
    for (int e = 0; e < c.experts; ++e)
      edl(tk, e) = ep(tk, e) * std::fabs(dp[idx(e)] - dot) + probs(tk, e) * (edp[idx(e)] + edot) +
                   4 * u * std::fabs(dlogits(tk, e));
  }
  // y = x + the k choices' gate o; dx = dy + the k choices' dx_e + dlogits Wr^T; each
  // addition rounded (an ulp of the result).
  Tensor ey(c.tokens, c.hidden),
      edx = product_error_bound(dlogits, edl, transpose(all.router), Tensor());
  for (int tk = 0; tk < c.tokens; ++tk)
    for (int j = 0; j < c.k; ++j) {
      const Index ch = idx(r.at(tk, j));
      if (row[ch] < 0) continue;
      for (std::int64_t d = 0; d < c.hidden; ++d) {
        ey(tk, d) += r.gate[ch] * e_outs(row[ch], d) + eg[ch] * std::fabs(outs(row[ch], d));
        edx(tk, d) += e_dins(row[ch], d);
      }
    }
  const double k = c.k;
  t.y = max_abs(ey) + 2 * k * u * max_abs(ref.y);
  t.dx = max_abs(edx) + 2 * (k + 1) * u * max_abs(ref.dx);
  t.drouter = max_abs(product_error_bound(transpose(x), Tensor(), dlogits, edl));
  return t;
}

}  // namespace ch07

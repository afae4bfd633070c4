// Chapter 07's MoE layer: the router, the experts, the combine, and their backward — once
// on one device, once with the tokens travelling to their experts' ranks.
#include "moe.hpp"

#include <algorithm>
#include <cmath>

#include "shardlab/check.hpp"

using namespace shardlab;

namespace ch07 {

int expert_capacity(int tokens, int k, int experts, double capacity_factor) {
  const double c = std::ceil(static_cast<double>(k) * tokens * capacity_factor / experts - 1e-9);
  // An expert never gets more than every token once: a larger C changes nothing.
  return static_cast<int>(std::clamp(c, 1.0, static_cast<double>(std::max(tokens, 1))));
}

Weights make_weights(const MoeConfig& c, int first, int count) {
  const std::int64_t d = c.hidden, h = c.ffn;
  Weights w;
  w.first = first;
  w.router = scale(randn(Shape{d, c.experts}, c.seed * 7919 + 1), 1.0f / std::sqrt(static_cast<float>(d)));
  for (int e = first; e < first + count; ++e) {
    const std::uint64_t s = c.seed * 7919 + 100 + 2 * static_cast<std::uint64_t>(e);
    w.w1.push_back(scale(randn(Shape{d, h}, s), 1.0f / std::sqrt(static_cast<float>(d))));
    w.w2.push_back(scale(randn(Shape{h, d}, s + 1), 1.0f / std::sqrt(static_cast<float>(h))));
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

/// Per expert, its kept choices in slot order: the rows its buffer holds.
std::vector<std::vector<int>> rows_by_expert(const Routing& r) {
  std::vector<std::vector<int>> rows(static_cast<std::size_t>(r.experts));
  for (auto& v : rows) v.assign(static_cast<std::size_t>(r.capacity), -1);
  for (int c = 0; c < r.tokens * r.k; ++c)
    if (r.slot[static_cast<std::size_t>(c)] >= 0)
      rows[static_cast<std::size_t>(r.expert[static_cast<std::size_t>(c)])]
          [static_cast<std::size_t>(r.slot[static_cast<std::size_t>(c)])] = c;
  for (auto& v : rows) v.erase(std::find(v.begin(), v.end(), -1), v.end());
  return rows;
}

/// One expert on its rows X (in slot order): what the backward needs, and the output.
struct ExpertRun {
  Tensor x, h, out;
};
ExpertRun expert_forward(const Tensor& x, const Tensor& w1, const Tensor& w2) {
  ExpertRun run{x, tanh(matmul(x, w1)), {}};
  run.out = matmul(run.h, w2);
  return run;
}
/// dL/dX of the expert's rows, and its weights' gradients (added into dw1, dw2).
Tensor expert_backward(const ExpertRun& run, const Tensor& dout, const Tensor& w1, const Tensor& w2,
                       Tensor& dw1, Tensor& dw2) {
  dw2 = matmul(run.h, dout, true, false);
  const Tensor dz = tanh_backward(run.h, matmul(dout, w2, false, true));
  dw1 = matmul(run.x, dz, true, false);
  return matmul(dz, w1, false, true);
}

/// Index tensor of rows.
Tensor index_of(const std::vector<int>& rows, Memory memory) {
  std::vector<std::int32_t> v(rows.begin(), rows.end());
  return Tensor::from_vector(v).to(memory);
}

/// The statistics of a routing, and the aux loss with the router probabilities of every
/// token.
void statistics(const MoeConfig& c, const Routing& r, const Tensor& probs_all, Result& out,
                std::vector<float>& f) {
  const int E = c.experts, T = c.tokens;
  out.wanted.assign(static_cast<std::size_t>(E), 0);
  out.kept.assign(static_cast<std::size_t>(E), 0);
  f.assign(static_cast<std::size_t>(E), 0.0f);
  out.dropped = out.passed_through = 0;
  for (int t = 0; t < T; ++t) {
    bool any = false;
    for (int j = 0; j < c.k; ++j) {
      const auto ch = static_cast<std::size_t>(r.at(t, j));
      const auto e = static_cast<std::size_t>(r.expert[ch]);
      ++out.wanted[e];
      if (r.slot[ch] >= 0) {
        ++out.kept[e];
        any = true;
      } else {
        ++out.dropped;
      }
    }
    if (!any) ++out.passed_through;
    f[static_cast<std::size_t>(r.expert[static_cast<std::size_t>(r.at(t, 0))])] += 1.0f / static_cast<float>(T);
  }
  double aux = 0;
  for (int e = 0; e < E; ++e) {
    double P = 0;
    for (int t = 0; t < T; ++t) P += probs_all(t, e);
    aux += f[static_cast<std::size_t>(e)] * (P / T);
  }
  out.aux_loss = c.aux_alpha * E * aux;
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
      const auto c = static_cast<std::size_t>(r.at(static_cast<int>(offset + t), j));
      if (row[c] < 0) continue;
      const float g = r.gate[c];
      for (std::int64_t i = 0; i < d; ++i) y(t, i) += g * o(row[c], i);
    }
  return y;
}

/// dL/dgate of every kept choice of tokens [offset, offset + rows): dy . the expert's
/// output. And the rows gate * dy that the experts' backward starts from.
std::vector<float> gate_grads(const Tensor& dy, const Routing& r, std::int64_t offset, const std::vector<int>& row,
                              const Tensor& outs) {
  std::vector<float> dg(static_cast<std::size_t>(r.tokens * r.k), 0.0f);
  const Tensor o = outs.to(Memory::host), g = dy.to(Memory::host);
  for (std::int64_t t = 0; t < g.rows(); ++t)
    for (int j = 0; j < r.k; ++j) {
      const auto c = static_cast<std::size_t>(r.at(static_cast<int>(offset + t), j));
      if (row[c] < 0) continue;
      float s = 0;
      for (std::int64_t i = 0; i < g.cols(); ++i) s += g(t, i) * o(row[c], i);
      dg[c] = s;
    }
  return dg;
}

/// dL/dlogits of tokens [offset, offset + rows): through the gates (renormalised for
/// k > 1) and the aux loss (f held constant), then the softmax.
Tensor router_grad(const MoeConfig& c, const Routing& r, std::int64_t offset, const Tensor& probs,
                   const std::vector<float>& dgate, const std::vector<float>& f) {
  const std::int64_t rows = probs.rows(), E = c.experts;
  Tensor dlogits(rows, E);
  std::vector<float> dp(static_cast<std::size_t>(E));
  const float aux = static_cast<float>(c.aux_alpha * c.experts / c.tokens);
  for (std::int64_t t = 0; t < rows; ++t) {
    for (std::int64_t e = 0; e < E; ++e) dp[static_cast<std::size_t>(e)] = aux * f[static_cast<std::size_t>(e)];
    const int tt = static_cast<int>(offset + t);
    if (c.k == 1) {
      const auto ch = static_cast<std::size_t>(r.at(tt, 0));
      dp[static_cast<std::size_t>(r.expert[ch])] += dgate[ch];
    } else {
      // gate_j = p_j / S, S = sum of the chosen p: dgate_j/dp_i = [i == j] / S - p_j / S^2.
      float S = 0, weighted = 0;
      for (int j = 0; j < c.k; ++j) {
        const auto ch = static_cast<std::size_t>(r.at(tt, j));
        S += probs(t, r.expert[ch]);
      }
      for (int j = 0; j < c.k; ++j) {
        const auto ch = static_cast<std::size_t>(r.at(tt, j));
        weighted += dgate[ch] * probs(t, r.expert[ch]);
      }
      for (int j = 0; j < c.k; ++j) {
        const auto ch = static_cast<std::size_t>(r.at(tt, j));
        dp[static_cast<std::size_t>(r.expert[ch])] += dgate[ch] / S - weighted / (S * S);
      }
    }
    float dot = 0;
    for (std::int64_t e = 0; e < E; ++e) dot += probs(t, e) * dp[static_cast<std::size_t>(e)];
    for (std::int64_t e = 0; e < E; ++e) dlogits(t, e) = probs(t, e) * (dp[static_cast<std::size_t>(e)] - dot);
  }
  return dlogits;
}

/// dx = dy + the experts' dL/dx rows (in j order) + dlogits @ router^T.
Tensor input_grad(const Tensor& dy, const Routing& r, std::int64_t offset, const std::vector<int>& row,
                  const Tensor& dins, const Tensor& dlogits, const Tensor& router) {
  Tensor dx = dy.to(Memory::host).clone();
  const Tensor di = dins.to(Memory::host);
  for (std::int64_t t = 0; t < dx.rows(); ++t)
    for (int j = 0; j < r.k; ++j) {
      const auto c = static_cast<std::size_t>(r.at(static_cast<int>(offset + t), j));
      if (row[c] < 0) continue;
      for (std::int64_t i = 0; i < dx.cols(); ++i) dx(t, i) += di(row[c], i);
    }
  const Tensor through_router = matmul(dlogits, router.to(Memory::host), false, true);
  axpy(1.0f, through_router, dx);
  return dx;
}

}  // namespace

Result moe_reference(const MoeConfig& c, const Weights& all, const Tensor& x, const Tensor& dy) {
  require(x.ndim() == 2 && x.rows() == c.tokens && x.cols() == c.hidden &&
              static_cast<int>(all.w1.size()) == c.experts && (!dy.defined() || dy.same_shape(x)),
          [&] {
            return "moe_reference: x " + x.describe() + ", dy " + (dy.defined() ? dy.describe() : "none") +
                   " for " + std::to_string(c.tokens) + " tokens of " + std::to_string(c.hidden) + " and " +
                   std::to_string(all.w1.size()) + " of " + std::to_string(c.experts) + " experts";
          });
  Result out;
  const Tensor probs = router_probs(x, all.router);
  out.routing = route(probs, c.k, c.capacity());
  const Routing& r = out.routing;
  std::vector<float> f;
  statistics(c, r, probs, out, f);
  // Each expert runs its rows, gathered straight from x in slot order.
  const auto rows = rows_by_expert(r);
  std::vector<int> row(static_cast<std::size_t>(c.tokens * c.k), -1);  // choice -> row of outs
  std::vector<int> token_of;
  for (int e = 0; e < c.experts; ++e)
    for (int ch : rows[static_cast<std::size_t>(e)]) {
      row[static_cast<std::size_t>(ch)] = static_cast<int>(token_of.size());
      token_of.push_back(ch / c.k);
    }
  Tensor outs(static_cast<std::int64_t>(token_of.size()), c.hidden);
  std::vector<ExpertRun> runs;
  std::int64_t at = 0;
  for (int e = 0; e < c.experts; ++e) {
    const auto& mine = rows[static_cast<std::size_t>(e)];
    std::vector<int> tokens;
    for (int ch : mine) tokens.push_back(ch / c.k);
    runs.push_back(expert_forward(gather_rows(x, index_of(tokens, Memory::host)), all.w1[static_cast<std::size_t>(e)],
                                  all.w2[static_cast<std::size_t>(e)]));
    if (!mine.empty()) outs.slice(at, static_cast<std::int64_t>(mine.size())).copy_from(runs.back().out);
    at += static_cast<std::int64_t>(mine.size());
  }
  out.y = combine(x, r, 0, row, outs);
  if (!dy.defined()) return out;
  // Backward.
  const std::vector<float> dgate = gate_grads(dy, r, 0, row, outs);
  Tensor dins(static_cast<std::int64_t>(token_of.size()), c.hidden);
  at = 0;
  for (int e = 0; e < c.experts; ++e) {
    const auto& mine = rows[static_cast<std::size_t>(e)];
    Tensor dout(static_cast<std::int64_t>(mine.size()), c.hidden);
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const auto ch = static_cast<std::size_t>(mine[i]);
      for (std::int64_t d = 0; d < c.hidden; ++d)
        dout(static_cast<std::int64_t>(i), d) = r.gate[ch] * dy(mine[i] / c.k, d);
    }
    Tensor dw1, dw2;
    const Tensor dxe = expert_backward(runs[static_cast<std::size_t>(e)], dout, all.w1[static_cast<std::size_t>(e)],
                                       all.w2[static_cast<std::size_t>(e)], dw1, dw2);
    out.dw1.push_back(dw1);
    out.dw2.push_back(dw2);
    if (!mine.empty()) dins.slice(at, static_cast<std::int64_t>(mine.size())).copy_from(dxe);
    at += static_cast<std::int64_t>(mine.size());
  }
  const Tensor dlogits = router_grad(c, r, 0, probs, dgate, f);
  out.drouter = matmul(x, dlogits, true, false);
  out.dx = input_grad(dy, r, 0, row, dins, dlogits, all.router);
  return out;
}

Result moe_parallel(Communicator& comm, const MoeConfig& c, const Weights& mine, const Tensor& x_host,
                    const Tensor& dy, Memory memory) {
  const int N = comm.size(), rank = comm.rank();
  const int per = c.experts / N;
  require(c.experts % N == 0 && per == static_cast<int>(mine.w1.size()) && mine.first == rank * per, [&] {
    return "moe_parallel: " + std::to_string(c.experts) + " experts over " + std::to_string(N) +
           " ranks, this rank holding " + std::to_string(mine.w1.size()) + " from " + std::to_string(mine.first);
  });
  const ShardRange tokens = shard_range(c.tokens, N, rank);
  require(x_host.ndim() == 2 && x_host.rows() == tokens.length && x_host.cols() == c.hidden &&
              (!dy.defined() || dy.same_shape(x_host)),
          [&] {
            return "moe_parallel: rank " + std::to_string(rank) + " has x " + x_host.describe() +
                   (dy.defined() ? ", dy " + dy.describe() : std::string()) + "; shard_range gives it " +
                   std::to_string(tokens.length) + " tokens of " + std::to_string(c.hidden);
          });
  const std::int64_t d = c.hidden;
  Result out;
  // 1. Route every token alike on every rank: the router's probabilities of all tokens.
  const Tensor x = x_host.to(memory);
  const Tensor probs_mine = router_probs(x, mine.router.to(memory));
  std::vector<Tensor> w1, w2;  // this rank's experts, where they compute (copied once)
  for (int l = 0; l < per; ++l) {
    w1.push_back(mine.w1[static_cast<std::size_t>(l)].to(memory));
    w2.push_back(mine.w2[static_cast<std::size_t>(l)].to(memory));
  }
  Tensor probs(c.tokens, c.experts);
  comm.allgatherv(probs_mine, probs, shard_counts(c.tokens, N, c.experts));
  out.routing = route(probs, c.k, c.capacity());
  const Routing& r = out.routing;
  std::vector<float> f;
  statistics(c, r, probs, out, f);
  const Dispatch plan = plan_dispatch(r, rank, N);
  auto times_d = [&](const std::vector<std::size_t>& counts) {
    std::vector<std::size_t> v(counts);
    for (auto& n : v) n *= static_cast<std::size_t>(d);
    return v;
  };
  const auto send_elems = times_d(plan.send_counts), recv_elems = times_d(plan.recv_counts);
  const auto n_send = static_cast<std::int64_t>(plan.send_order.size());
  const auto n_recv = static_cast<std::int64_t>(plan.recv_choice.size());
  const CommStats before = comm.stats();
  // 2. Dispatch: this rank's token rows, in send order, to their experts' ranks.
  std::vector<int> send_tokens;
  for (int ch : plan.send_order) send_tokens.push_back(ch / c.k - static_cast<int>(tokens.offset));
  const Tensor send = gather_rows(x, index_of(send_tokens, memory));
  Tensor recv(Shape{n_recv, d}, DType::f32, memory);
  comm.alltoallv(send, send_elems, recv, recv_elems);
  // 3. Each local expert runs its rows, in slot order.
  std::vector<int> recv_row(static_cast<std::size_t>(c.tokens * c.k), -1);
  for (std::size_t i = 0; i < plan.recv_choice.size(); ++i)
    recv_row[static_cast<std::size_t>(plan.recv_choice[i])] = static_cast<int>(i);
  const auto all_rows = rows_by_expert(r);
  Tensor outs_recv(Shape{n_recv, d}, DType::f32, memory);
  std::vector<ExpertRun> runs;
  std::vector<Tensor> where;  // per local expert: its rows' places in the receive buffer
  for (int l = 0; l < per; ++l) {
    std::vector<int> at;
    for (int ch : all_rows[static_cast<std::size_t>(mine.first + l)]) at.push_back(recv_row[static_cast<std::size_t>(ch)]);
    where.push_back(index_of(at, memory));
    runs.push_back(expert_forward(gather_rows(recv, where.back()), w1[static_cast<std::size_t>(l)],
                                  w2[static_cast<std::size_t>(l)]));
    if (!at.empty()) scatter_add_rows(outs_recv, where.back(), runs.back().out);
  }
  // 4. Combine: the outputs go back the way they came.
  Tensor back(Shape{n_send, d}, DType::f32, memory);
  comm.alltoallv(outs_recv, recv_elems, back, send_elems);
  std::vector<int> send_row(static_cast<std::size_t>(c.tokens * c.k), -1);
  for (std::size_t i = 0; i < plan.send_order.size(); ++i)
    send_row[static_cast<std::size_t>(plan.send_order[i])] = static_cast<int>(i);
  out.y = combine(x, r, tokens.offset, send_row, back);
  // A rank may hold no tokens (T < N): it still joins every collective of the backward.
  if (dy.defined()) {
    // Backward: gate * dy to the experts the same way, their dL/dx back.
    const std::vector<float> dgate = gate_grads(dy, r, tokens.offset, send_row, back);
    Tensor scaled(n_send, d);
    const Tensor dyh = dy.to(Memory::host);
    for (std::int64_t i = 0; i < n_send; ++i) {
      const auto ch = static_cast<std::size_t>(plan.send_order[static_cast<std::size_t>(i)]);
      for (std::int64_t e = 0; e < d; ++e) scaled(i, e) = r.gate[ch] * dyh(send_tokens[static_cast<std::size_t>(i)], e);
    }
    Tensor grads_recv(Shape{n_recv, d}, DType::f32, memory);
    comm.alltoallv(scaled.to(memory), send_elems, grads_recv, recv_elems);
    Tensor dins_recv(Shape{n_recv, d}, DType::f32, memory);
    for (int l = 0; l < per; ++l) {
      Tensor dw1, dw2;
      const Tensor dxe = expert_backward(runs[static_cast<std::size_t>(l)],
                                         gather_rows(grads_recv, where[static_cast<std::size_t>(l)]),
                                         w1[static_cast<std::size_t>(l)], w2[static_cast<std::size_t>(l)], dw1, dw2);
      out.dw1.push_back(dw1.to(Memory::host));
      out.dw2.push_back(dw2.to(Memory::host));
      if (dxe.rows()) scatter_add_rows(dins_recv, where[static_cast<std::size_t>(l)], dxe);
    }
    Tensor dins(Shape{n_send, d}, DType::f32, memory);
    comm.alltoallv(dins_recv, recv_elems, dins, send_elems);
    const Tensor dlogits = router_grad(c, r, tokens.offset, probs_mine, dgate, f);
    out.drouter = matmul(x_host, dlogits, true, false);
    comm.allreduce(out.drouter, ReduceOp::sum);  // the router is every rank's: its gradient the sum
    out.dx = input_grad(dy, r, tokens.offset, send_row, dins, dlogits, mine.router);
  }
  const CommStats moved = comm.stats().since(before);
  out.alltoall_received = moved[Op::alltoall].bytes_received;
  out.traffic_modeled = moved.is_modeled(Op::alltoall);
  out.y = out.y.to(Memory::host);
  return out;
}

}  // namespace ch07

// Chapter 01's strategy table (see strategies.hpp).
#include "strategies.hpp"

namespace ch01 {

const std::vector<Strategy>& strategies() {
  static const std::vector<Strategy> table = {
      {"data_parallel", "Data parallel", "x along dim 0 (rows); w whole on every rank",
       "allgather of out's row shards", data_parallel_matmul, 0, -1, 0, true, 1, "(P-1)*M*N"},
      {"column_parallel", "Model (column) parallel",
       "w along dim 1 (columns); x whole on every rank", "allgather of out's column shards",
       column_parallel_matmul, -1, 1, 1, true, 1, "(P-1)*M*N"},
      {"row_parallel", "Row parallel", "x along dim 1 and w along dim 0 (the inner dimension K)",
       "allreduce (sum) of M x N partial products", row_parallel_matmul, 1, 0, -1, false, 2,
       "2*(P-1)*M*N"},
  };
  return table;
}

std::uint64_t Strategy::elements_received(int P, const Dims& d) const {
  return copies * static_cast<std::uint64_t>(P - 1) * static_cast<std::uint64_t>(d.M * d.N);
}

std::string Strategy::share(const Dims& d, int P, int r) const {
  // Read off the splits: dim 0 of x is M and dim 1 is K; of w, K and N; of out, M and N.
  auto piece = [&](int split, std::int64_t rows, std::int64_t cols) {
    if (split < 0) return std::string();
    return " " + part(split == 0 ? "row" : "column", split == 0 ? rows : cols, P, r);
  };
  return "x" + piece(x_split, d.M, d.K) + " @ w" + piece(w_split, d.K, d.N) + " -> " +
         (out_split < 0 ? "a partial sum of all of out" : "out" + piece(out_split, d.M, d.N));
}

std::string part(const std::string& noun, std::int64_t size, int P, int r) {
  const shardlab::ShardRange s = shardlab::shard_range(size, P, r);
  if (s.length == 0) return "no " + noun + "s";
  if (s.length == 1) return noun + " " + std::to_string(s.offset);
  return noun + "s " + std::to_string(s.offset) + "-" + std::to_string(s.offset + s.length - 1);
}

}  // namespace ch01

// toy: the one small model and data set the chapters train when the model is not the
// point — a stack of Linear layers with tanh between them, fit to a fixed random teacher.
//
//   toy::MlpConfig student{.widths = {16, 64, 1}, .seed = seed};
//   nn::ParameterStore store;
//   nn::Sequential model = toy::mlp(store, student);   // Linear(16, 64), tanh, Linear(64, 1)
//   store.allocate();
//   toy::Teacher teacher(student, seed);                // y = teacher(x), same shape
//   toy::Batch b = teacher.batch(64, step);             // x: 64 x 16 ~ N(0, 1), y: 64 x 1
//
// Layer l's weights come from layer_seed(seed, l) alone, so any slice of the model (a
// pipeline stage, a rank's blocks) builds exactly the weights the whole model has.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardlab/nn.hpp"
#include "shardlab/tensor.hpp"

namespace shardlab::toy {

/// The shape of a toy MLP, and where its weights come from.
struct MlpConfig {
  std::vector<std::int64_t> widths;  ///< widths[0] inputs ... widths.back() outputs.
  bool bias = true;                  ///< Each Linear adds a bias (0 at the start).
  bool tanh_last = false;            ///< A tanh after the last Linear too.
  std::uint64_t seed = 0;            ///< Layer l's weights come from layer_seed(seed, l).
  std::string prefix = "layer";      ///< Parameter names: layer0.weight, layer0.bias, ...
  /// The number of Linear layers: widths.size() - 1.
  int layers() const { return static_cast<int>(widths.size()) - 1; }
};

/// The seed of layer l's weights.
inline std::uint64_t layer_seed(std::uint64_t seed, int layer) {
  return seed * 1000003ull + static_cast<std::uint64_t>(layer);
}

/// Layers [first, last) of the model (last = -1: to the end), added to `store`:
/// Linear(widths[l], widths[l + 1]) (LeCun init from layer_seed), then tanh unless it is
/// the model's last layer and !tanh_last.
nn::Sequential mlp(nn::ParameterStore& store, const MlpConfig& config, int first = 0,
                   int last = -1);

/// One batch of the teacher's data (host, f32).
struct Batch {
  Tensor x;  ///< The inputs, rows x widths[0].
  Tensor y;  ///< The targets, teacher(x): rows x widths.back().
};

/// The data: x ~ N(0, 1), y = scale * teacher(x) for a fixed random network of `shape`'s
/// widths (its own seed stream, never the student's weights). batch(rows, step) draws
/// step's batch afresh, identically on every rank.
class Teacher {
 public:
  /// A network of `shape`'s widths, bias and tanh_last (its seed and prefix are not used),
  /// with weights from `seed`, whose outputs are multiplied by `scale`.
  explicit Teacher(MlpConfig shape, std::uint64_t seed, double scale = 1.0);
  /// Step `step`'s batch of `rows` rows, drawn from `seed` and `step` alone.
  Batch batch(std::int64_t rows, int step) const;
  /// y for a given x (host, f32).
  Tensor operator()(const Tensor& x) const;
  /// The number of input features: widths[0].
  std::int64_t inputs() const { return config_.widths.front(); }

 private:
  MlpConfig config_;
  std::uint64_t seed_;
  double scale_;
  std::unique_ptr<nn::ParameterStore> store_;  // stays put: the layers point into it
  nn::Sequential net_;
};

}  // namespace shardlab::toy

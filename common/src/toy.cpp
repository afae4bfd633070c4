// toy: the small model and data set (see toy.hpp).
#include "shardlab/toy.hpp"

#include "shardlab/check.hpp"

namespace shardlab::toy {

nn::Sequential mlp(nn::ParameterStore& store, const MlpConfig& config, int first, int last) {
  const int layers = config.layers();
  if (last < 0) last = layers;
  require(layers >= 1 && 0 <= first && first <= last && last <= layers, [&] {
    return "toy::mlp: layers [" + std::to_string(first) + ", " + std::to_string(last) +
           ") of a model of " + std::to_string(layers);
  });
  nn::Sequential seq;
  for (int l = first; l < last; ++l) {
    const auto i = static_cast<std::size_t>(l);
    seq.add<nn::Linear>(store, config.prefix + std::to_string(l), config.widths[i],
                        config.widths[i + 1], layer_seed(config.seed, l), config.bias);
    if (l + 1 < layers || config.tanh_last) seq.add<nn::Tanh>();
  }
  return seq;
}

Teacher::Teacher(MlpConfig shape, std::uint64_t seed, double scale)
    : config_(std::move(shape)),
      seed_(seed),
      scale_(scale),
      store_(std::make_unique<nn::ParameterStore>()) {
  config_.seed = seed * 7919ull + 0x7eac4e5ull;  // not the student's stream
  config_.prefix = "teacher";
  net_ = mlp(*store_, config_);
  store_->allocate();
}

Tensor Teacher::operator()(const Tensor& x) const {
  Tensor y = net_.forward(x).out;
  if (scale_ != 1.0) y = shardlab::scale(y, static_cast<float>(scale_));
  return y;
}

Batch Teacher::batch(std::int64_t rows, int step) const {
  Tensor x = randn(rows, inputs(), seed_ * 1000003ull + 17ull + static_cast<std::uint64_t>(step));
  Tensor y = (*this)(x);
  return {std::move(x), std::move(y)};
}

}  // namespace shardlab::toy

// DeviceMesh: coordinates are one row-major reshape of the world ranks; each axis's
// communicator is one split of the world (see mesh.hpp).
#include "shardlab/mesh.hpp"

#include <algorithm>

#include "shardlab/check.hpp"

namespace shardlab {

DeviceMesh::DeviceMesh(Communicator& world, std::vector<int> shape, std::vector<std::string> names)
    : world_(world), shape_(std::move(shape)), names_(std::move(names)) {
  require(!shape_.empty() && shape_.size() == names_.size(), [&] {
    return "DeviceMesh: one name per axis (" + std::to_string(shape_.size()) + " axes, " +
           std::to_string(names_.size()) + " names)";
  });
  long long product = 1;
  std::string text;
  for (std::size_t a = 0; a < shape_.size(); ++a) {
    require(shape_[a] >= 1, [&] {
      return "DeviceMesh: axis " + names_[a] + " has size " + std::to_string(shape_[a]);
    });
    require(std::count(names_.begin(), names_.end(), names_[a]) == 1,
            [&] { return "DeviceMesh: two axes are called " + names_[a]; });
    product *= shape_[a];
    text += (a ? " x " : "") + names_[a] + " " + std::to_string(shape_[a]);
  }
  require(product == world.size(), [&] {
    return "DeviceMesh: " + text + " is " + std::to_string(product) + " ranks, but the job has " +
           std::to_string(world.size());
  });
  coords_ = coords_of(world.rank());
  // Axis a's group: the ranks that share every other coordinate. Its colour is this rank's
  // position with coordinate a set to 0; its order is coordinate a.
  for (std::size_t a = 0; a < shape_.size(); ++a) {
    std::vector<int> base = coords_;
    base[a] = 0;
    axes_.push_back(world.split(rank_at(base), coords_[a]));
  }
}

int DeviceMesh::axis_index(std::string_view name) const {
  const auto it = std::find(names_.begin(), names_.end(), name);
  require(it != names_.end(), [&] { return "DeviceMesh: no axis called " + std::string(name); });
  return static_cast<int>(it - names_.begin());
}

int DeviceMesh::rank_at(const std::vector<int>& coords) const {
  require(coords.size() == shape_.size(), [&] {
    return "DeviceMesh::rank_at: " + std::to_string(coords.size()) + " coordinates for " +
           std::to_string(shape_.size()) + " axes";
  });
  int rank = 0;
  for (std::size_t a = 0; a < shape_.size(); ++a) {
    require(coords[a] >= 0 && coords[a] < shape_[a], [&] {
      return "DeviceMesh::rank_at: coordinate " + std::to_string(coords[a]) + " on axis " +
             names_[a] + " of size " + std::to_string(shape_[a]);
    });
    rank = rank * shape_[a] + coords[a];
  }
  return rank;
}

std::vector<int> DeviceMesh::coords_of(int rank) const {
  std::vector<int> c(shape_.size());
  for (std::size_t a = shape_.size(); a-- > 0;) {
    c[a] = rank % shape_[a];
    rank /= shape_[a];
  }
  return c;
}

Communicator& DeviceMesh::axis(std::string_view name) {
  return *axes_[static_cast<std::size_t>(axis_index(name))];
}

CommStats DeviceMesh::axis_stats() const {
  CommStats sum;
  for (const auto& a : axes_) sum += a->stats();
  return sum;
}

}  // namespace shardlab

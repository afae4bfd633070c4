// testing: the tensor comparison behind check_close.
#include "shardlab/testing.hpp"

#include <cmath>
#include <cstring>
#include <sstream>

namespace shardlab::testing {

std::string compare(const Tensor& got, const Tensor& want, float atol, float rtol) {
  std::ostringstream os;
  if (!got.same_shape(want)) {
    os << "shape " << got.shape_string() << ", expected " << want.shape_string();
    return os.str();
  }
  std::int64_t bad = 0;
  float worst = 0.0f;
  std::ostringstream first;
  for (std::int64_t i = 0; i < got.size(); ++i) {
    const float g = got[i], w = want[i];
    const float diff = std::fabs(g - w);
    const bool same_bits = std::memcmp(&g, &w, sizeof g) == 0;
    const bool close = same_bits || diff <= atol + rtol * std::fabs(w);
    if (!std::isnan(diff)) worst = std::max(worst, diff);
    if (close) continue;
    if (bad < 5) {
      first << "\n    [" << i;
      if (got.ndim() == 2) first << " = (" << i / got.cols() << ", " << i % got.cols() << ")";
      first << "] got " << g << ", expected " << w;
    }
    ++bad;
  }
  if (bad == 0) return "";
  os.precision(9);
  os << bad << " of " << got.size() << " elements differ (atol " << atol << ", rtol " << rtol
     << "), max abs diff " << worst << "; first:" << first.str();
  return os.str();
}

}  // namespace shardlab::testing

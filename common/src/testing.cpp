// testing: the tensor comparison behind check_close.
#include "shardlab/testing.hpp"

#include <cmath>
#include <sstream>

namespace shardlab::testing {

std::string compare(const Tensor& got, const Tensor& want, float atol, float rtol) {
  std::ostringstream os;
  if (!got.same_shape(want) || got.dtype() != want.dtype()) {
    os << got.describe() << ", expected " << want.describe();
    return os.str();
  }
  const Tensor g = cast(got.to(Memory::host), DType::f64),
               w = cast(want.to(Memory::host), DType::f64);
  const double* pg = g.data<double>();
  const double* pw = w.data<double>();
  std::int64_t bad = 0, nans = 0;
  double worst = 0.0;
  std::ostringstream first;
  first.precision(9);  // float's 9 digits: two floats that differ never print alike
  for (std::int64_t i = 0; i < g.size(); ++i) {
    const double diff = std::fabs(pg[i] - pw[i]);
    // Equal values (infinities of one sign included) agree; NaN never does.
    const bool close = pg[i] == pw[i] || diff <= atol + rtol * std::fabs(pw[i]);
    if (!std::isnan(diff)) worst = std::max(worst, diff);
    if (close) continue;
    if (std::isnan(pg[i])) ++nans;
    if (bad < 5) {
      first << "\n    [" << i;
      if (got.ndim() == 2) first << " = (" << i / got.cols() << ", " << i % got.cols() << ")";
      first << "] got " << pg[i] << ", expected " << pw[i] << " (diff " << pg[i] - pw[i] << ")";
    }
    ++bad;
  }
  if (bad == 0) return "";
  os.precision(9);
  os << bad << " of " << got.size() << " elements differ (atol " << atol << ", rtol " << rtol
     << "), ";
  if (nans) os << nans << " of them NaN, ";
  os << "max abs diff " << (nans == bad ? std::nan("") : worst) << "; first:" << first.str();
  return os.str();
}

}  // namespace shardlab::testing

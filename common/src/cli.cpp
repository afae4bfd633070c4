// cli: numbers from the command line (see cli.hpp).
#include "shardlab/cli.hpp"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

namespace shardlab::cli {

namespace {

/// The whole of `text` as a double (strtod: decimal, 1e-3, hex floats). Underflow to a
/// subnormal or to zero is a number; overflow and anything left over are not.
double parse_plain(const std::string& text, const std::string& shown) {
  if (text.empty()) throw std::invalid_argument("'" + shown + "' is not a number");
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0')
    throw std::invalid_argument("'" + shown + "' is not a number");
  if (errno == ERANGE && std::isinf(value))
    throw std::invalid_argument(shown + " is too large for a double (above 1.8e308)");
  return value;
}

}  // namespace

double parse_quantity(const std::string& text, Units units) {
  if (text.rfind("2^", 0) == 0) {
    const double k = parse_plain(text.substr(2), text);
    if (!std::isfinite(k) || k != std::round(k) || std::fabs(k) > 1100)
      throw std::invalid_argument(text + ": 2^k needs a whole k from -1100 to 1100");
    const double value = std::ldexp(1.0, static_cast<int>(k));
    if (std::isinf(value)) throw std::invalid_argument(text + " is too large for a double");
    return value;
  }
  double unit = 1;
  std::string number = text;
  if (!text.empty()) {
    const bool binary = units == Units::binary;
    switch (text.back()) {
      case 'k':
      case 'K':
        unit = binary ? 0x1p10 : 1e3;
        break;
      case 'm':
      case 'M':
        unit = binary ? 0x1p20 : 1e6;
        break;
      case 'g':
      case 'G':
        unit = binary ? 0x1p30 : 1e9;
        break;
      case 'b':
      case 'B':
        unit = binary ? 0 : 1e9;
        break;
      case 't':
      case 'T':
        unit = binary ? 0x1p40 : 1e12;
        break;
      default:
        break;
    }
    if (unit == 0) throw std::invalid_argument("'" + text + "': sizes take K, M, G or T");
    if (unit != 1) number.pop_back();
  }
  const double value = parse_plain(number, text) * unit;
  if (std::isinf(value) && !std::isinf(parse_plain(number, text)))
    throw std::invalid_argument(text + " is too large for a double");
  return value;
}

CLI::Validator quantity(Units units) {
  return CLI::Validator(
      [units](std::string& text) -> std::string {
        try {
          const double value = parse_quantity(text, units);
          if (!std::isfinite(value)) return "'" + text + "' is not a finite number";
          // Whole numbers stay whole (an int option reads "65536", not "65536.0").
          char buf[64];
          if (value == std::round(value) && std::fabs(value) < 9.007199254740992e15)
            std::snprintf(buf, sizeof buf, "%.0f", value);
          else
            std::snprintf(buf, sizeof buf, "%.17g", value);
          text = buf;
          return "";
        } catch (const std::invalid_argument& e) {
          return e.what();
        }
      },
      units == Units::binary ? "SIZE" : "NUMBER");
}

CLI::Validator between(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        double value = 0;
        try {
          value = parse_plain(text, text);
        } catch (const std::invalid_argument& e) {
          return e.what();
        }
        if (!std::isfinite(value)) return "'" + text + "' is not a finite number";
        if (value < lo || value > hi)
          return text + " is outside [" + format_number(lo) + ", " + format_number(hi) + "]";
        return "";
      },
      "[" + format_number(lo) + ", " + format_number(hi) + "]");
}

CLI::Validator whole(long long lo, long long hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
        std::size_t used = 0;
        long long value = 0;
        try {
          value = std::stoll(text, &used);
        } catch (const std::out_of_range&) {
          return text + " is outside " + range;
        } catch (const std::invalid_argument&) {
          used = 0;
        }
        if (used == 0 || used != text.size()) return "'" + text + "' is not a whole number";
        return value < lo || value > hi ? text + " is outside " + range : "";
      },
      "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

}  // namespace shardlab::cli

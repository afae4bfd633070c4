// Does -ftrivial-auto-var-init copy a structure whole? GCC 12.2 does not: clearing the
// padding of a temporary {enum, pointer, {array of 11 x 24-byte structs, array of 11
// bools}} it zeroes bytes 11-15 of the first struct instead of the 5 bytes at the end, so a
// counter copied there loses every bit from the 24th up (ShardLab's AxisMeter snapshot of
// CommStats, which made chapter 09's pp bytes 2^24 off after 64 steps). The learner build
// fills uninitialised locals only where this program exits 0.
#include <array>
#include <cstdint>
#include <vector>

struct Counters {
  std::uint64_t calls = 0, sent = 0, received = 0;
};
struct Stats {
  std::array<Counters, 11> ops{};
  std::array<bool, 11> modeled{};
};
enum class Kind { a, b };
struct Snapshot {
  Kind kind;
  const Stats* from;
  Stats start;
};

__attribute__((noinline)) void keep(std::vector<Snapshot>& out, Kind kind, const Stats& s) {
  out.push_back({kind, &s, s});
}

int main() {
  Stats s;
  for (std::size_t i = 0; i < s.ops.size(); ++i) s.ops[i] = {i + 1, 0x0123456789abcdefULL, ~i};
  std::vector<Snapshot> out;
  keep(out, Kind::b, s);
  for (std::size_t i = 0; i < s.ops.size(); ++i)
    if (out[0].start.ops[i].calls != s.ops[i].calls || out[0].start.ops[i].sent != s.ops[i].sent ||
        out[0].start.ops[i].received != s.ops[i].received)
      return 1;
  return 0;
}

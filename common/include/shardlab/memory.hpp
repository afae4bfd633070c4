// memory: a ledger of the bytes each rank's tensors hold, by what they are for.
//
// Chapter 05 asks where a training step's memory goes: parameters, gradients, the
// optimizer's state, fp32 master weights, activations, communication buffers. Every
// tensor allocation (host or device) is charged to the ledger of the thread that
// allocates it, under the category of the innermost memory::Scope alive on that thread,
// and released from that same ledger when its last view goes, on whatever thread. Views
// (slice, view, reshape) allocate nothing and count nothing.
//
//   memory::Tracker tracker;                          // counts from here, this thread
//   { memory::Scope s(memory::Category::optimizer);   // what follows is optimizer state
//     m = zeros(Shape{n}); v = zeros(Shape{n}); }
//   tracker.usage().live(memory::Category::optimizer)  // 8 n bytes
//
// Ranks are threads (or processes): each rank's thread has a ledger of its own, so the
// numbers are per rank. A Tracker counts what its thread allocates while it is alive, and
// so does every Tracker around it (and the thread's own ledger, memory::usage()).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

namespace shardlab::memory {

/// What an allocation is for: the rows of a ledger.
enum class Category : std::uint8_t {
  params,       ///< The weights a forward reads (fp16 or fp32).
  grads,        ///< Their gradients.
  optimizer,    ///< Adam's m and v (fp32).
  master,       ///< fp32 master weights of mixed precision.
  activations,  ///< What the forward keeps for the backward, and its temporaries.
  comm,         ///< Buffers a collective sends from or gathers into.
  other,        ///< Everything not in a Scope.
  count_        ///< Not a category: the number of them.
};
/// The number of categories: the length of Usage's arrays.
inline constexpr std::size_t category_count = static_cast<std::size_t>(Category::count_);
/// "params", "grads", "optimizer", "master", "activations", "comm", "other".
std::string_view category_name(Category c);

/// A snapshot of a ledger: bytes live now and the most ever live at once, per category
/// and in total (the total's peak is the peak of the sum, not the sum of the peaks).
struct Usage {
  /// Bytes live now, by Category.
  std::array<std::uint64_t, category_count> live_bytes{};
  /// The most bytes live at once, by Category.
  std::array<std::uint64_t, category_count> peak_bytes{};
  std::uint64_t live_total = 0;  ///< Bytes live now, all categories.
  std::uint64_t peak_total = 0;  ///< The most bytes live at once, all categories together.
  /// Bytes of category `c` live now.
  std::uint64_t live(Category c) const { return live_bytes[static_cast<std::size_t>(c)]; }
  /// The most bytes of category `c` live at once.
  std::uint64_t peak(Category c) const { return peak_bytes[static_cast<std::size_t>(c)]; }
};

/// Allocations on this thread are charged to `category` while the Scope is alive (Scopes
/// nest; the innermost wins).
class Scope {
 public:
  /// Charges this thread's allocations to `category` until the Scope is destroyed.
  explicit Scope(Category category);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Category previous_;
};
/// The category allocations on this thread are charged to now.
Category current_category();

class Ledger;  // live and peak counters, shared by the allocations charged to them

/// Counts every allocation this thread makes while it is alive (on top of the ledgers
/// already counting: the thread's own, and enclosing Trackers). Trackers nest like
/// scopes: one made on the stack ends before the one around it (an error otherwise).
class Tracker {
 public:
  /// Starts counting this thread's allocations.
  Tracker();
  ~Tracker();
  Tracker(const Tracker&) = delete;
  Tracker& operator=(const Tracker&) = delete;
  /// What it has counted: the allocations made since it started that are still alive,
  /// and the peaks.
  Usage usage() const;
  /// Peaks start again from what is live now.
  void reset_peaks();

 private:
  std::shared_ptr<Ledger> ledger_, previous_;
};

/// This thread's own ledger: everything it allocated that is still alive, and the peaks.
Usage usage();

/// One allocation's entry in the ledgers of the thread that made it (a tensor's storage
/// holds one): charged when made, released when destroyed.
class Charge {
 public:
  /// Charges `bytes` to this thread's current category, in every ledger counting now.
  explicit Charge(std::size_t bytes);
  ~Charge();
  Charge(const Charge&) = delete;
  Charge& operator=(const Charge&) = delete;

 private:
  std::shared_ptr<Ledger> ledger_;
  std::size_t bytes_;
  Category category_;
};

}  // namespace shardlab::memory

// The ledger: atomic counters (a tensor may be freed on another thread than the one that
// allocated it), chained from the innermost Tracker out to the thread's own ledger.
#include "shardlab/memory.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace shardlab::memory {

class Ledger {
 public:
  explicit Ledger(std::shared_ptr<Ledger> parent) : parent_(std::move(parent)) {}

  void add(Category c, std::uint64_t bytes) {
    for (Ledger* l = this; l; l = l->parent_.get()) {
      const std::size_t i = static_cast<std::size_t>(c);
      raise(l->peak_[i], l->live_[i].fetch_add(bytes) + bytes);
      raise(l->peak_total_, l->live_total_.fetch_add(bytes) + bytes);
    }
  }
  void remove(Category c, std::uint64_t bytes) {
    for (Ledger* l = this; l; l = l->parent_.get()) {
      l->live_[static_cast<std::size_t>(c)].fetch_sub(bytes);
      l->live_total_.fetch_sub(bytes);
    }
  }
  Usage usage() const {
    Usage u;
    for (std::size_t i = 0; i < category_count; ++i) {
      u.live_bytes[i] = live_[i].load();
      u.peak_bytes[i] = peak_[i].load();
    }
    u.live_total = live_total_.load();
    u.peak_total = peak_total_.load();
    return u;
  }
  void reset_peaks() {
    for (std::size_t i = 0; i < category_count; ++i) peak_[i].store(live_[i].load());
    peak_total_.store(live_total_.load());
  }
  const std::shared_ptr<Ledger>& parent() const { return parent_; }

 private:
  static void raise(std::atomic<std::uint64_t>& peak, std::uint64_t value) {
    std::uint64_t seen = peak.load();
    while (seen < value && !peak.compare_exchange_weak(seen, value)) {
    }
  }
  std::shared_ptr<Ledger> parent_;
  std::array<std::atomic<std::uint64_t>, category_count> live_{};
  std::array<std::atomic<std::uint64_t>, category_count> peak_{};
  std::atomic<std::uint64_t> live_total_{0}, peak_total_{0};
};

namespace {

thread_local Category t_category = Category::other;

/// The ledger this thread charges: its innermost Tracker's, or its own.
std::shared_ptr<Ledger>& current() {
  thread_local std::shared_ptr<Ledger> ledger = std::make_shared<Ledger>(nullptr);
  return ledger;
}

}  // namespace

std::string_view category_name(Category c) {
  switch (c) {
    case Category::params:
      return "params";
    case Category::grads:
      return "grads";
    case Category::optimizer:
      return "optimizer";
    case Category::master:
      return "master";
    case Category::activations:
      return "activations";
    case Category::comm:
      return "comm";
    case Category::other:
    case Category::count_:
      break;
  }
  return "other";
}

Scope::Scope(Category category) : previous_(t_category) { t_category = category; }
Scope::~Scope() { t_category = previous_; }
Category current_category() { return t_category; }

Tracker::Tracker() : ledger_(std::make_shared<Ledger>(current())), previous_(current()) {
  current() = ledger_;
}
Tracker::~Tracker() {
  // Only the innermost Tracker can step out of the chain; ending an outer one first
  // would leave the inner one counting into a ledger nobody reads.
  if (current() != ledger_) {
    std::fprintf(stderr, "memory::Tracker: ended while a Tracker made after it is alive\n");
    std::abort();
  }
  current() = previous_;
}
Usage Tracker::usage() const { return ledger_->usage(); }
void Tracker::reset_peaks() { ledger_->reset_peaks(); }

Usage usage() {
  Ledger* own = current().get();
  while (own->parent()) own = own->parent().get();
  return own->usage();
}

Charge::Charge(std::size_t bytes) : ledger_(current()), bytes_(bytes), category_(t_category) {
  ledger_->add(category_, bytes_);
}
Charge::~Charge() { ledger_->remove(category_, bytes_); }

}  // namespace shardlab::memory

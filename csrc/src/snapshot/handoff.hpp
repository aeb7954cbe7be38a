// Two-stage pipeline plumbing: a fixed set of buffer slots cycling free -> full -> free between
// one producer thread and one consumer thread, in FIFO order. Either side may fail(); the other
// side's next acquire then returns -1 and the first failure is kept for rethrow().
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>

namespace vitrify::snapshot::detail {

class Handoff {
 public:
  explicit Handoff(int slots) {
    for (int i = 0; i < slots; ++i) free_.push_back(i);
  }
  // A free slot for the producer; -1 after a failure.
  int acquire_free() {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return failed_ || !free_.empty(); });
    if (failed_) return -1;
    const int s = free_.front();
    free_.pop_front();
    return s;
  }
  void publish(int slot) {
    { std::lock_guard lk(m_); full_.push_back(slot); }
    cv_.notify_all();
  }
  // The next full slot for the consumer; -1 when the producer closed and all were drained, or
  // after a failure.
  int acquire_full() {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return failed_ || !full_.empty() || closed_; });
    if (failed_ || full_.empty()) return -1;
    const int s = full_.front();
    full_.pop_front();
    return s;
  }
  void release(int slot) {
    { std::lock_guard lk(m_); free_.push_back(slot); }
    cv_.notify_all();
  }
  void close() {
    { std::lock_guard lk(m_); closed_ = true; }
    cv_.notify_all();
  }
  void fail(std::exception_ptr e) noexcept {
    { std::lock_guard lk(m_); if (!err_) err_ = e; failed_ = true; }
    cv_.notify_all();
  }
  bool failed() {
    std::lock_guard lk(m_);
    return failed_;
  }
  void rethrow() {
    std::lock_guard lk(m_);
    if (err_) std::rethrow_exception(err_);
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<int> free_, full_;
  bool closed_ = false, failed_ = false;
  std::exception_ptr err_;
};

}  // namespace vitrify::snapshot::detail

// ThreadPool: fixed workers running indexed tasks; the caller of run() works on its own job too.
#include <exception>

#include "vitrify/error.hpp"
#include "vitrify/host.hpp"

namespace vitrify::host {

struct ThreadPool::Job {
  const std::function<void(size_t)>* fn = nullptr;
  size_t n = 0;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr error;
};

ThreadPool::ThreadPool(size_t threads) {
  VITRIFY_EXPECT(threads >= 1 && threads <= 1024,
              "thread count must be in [1, 1024], got " + std::to_string(threads));
  workers_.reserve(threads - 1);
  try {
    for (size_t i = 0; i + 1 < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  } catch (...) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::work_on(Job& job) {
  for (;;) {
    const size_t i = job.next.fetch_add(1);
    if (i >= job.n) return;
    try {
      (*job.fn)(i);
    } catch (...) {
      std::lock_guard<std::mutex> lk(job.mu);
      if (!job.error) job.error = std::current_exception();
    }
    if (job.done.fetch_add(1) + 1 == job.n) {
      std::lock_guard<std::mutex> lk(job.mu);  // the waiter checks `done` under this lock
      job.cv.notify_all();
    }
  }
}

void ThreadPool::worker_loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      job = queue_.front();
      if (job->next.load() >= job->n) {  // every task claimed: retire the job from the queue
        queue_.pop_front();
        continue;
      }
    }
    work_on(*job);
  }
}

void ThreadPool::run(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (n == 1 || workers_.empty()) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(job);
  }
  cv_.notify_all();
  work_on(*job);
  {
    std::unique_lock<std::mutex> lk(job->mu);
    job->cv.wait(lk, [&] { return job->done.load() == job->n; });
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = queue_.begin(); it != queue_.end(); ++it)
      if (*it == job) {
        queue_.erase(it);
        break;
      }
  }
  if (job->error) std::rethrow_exception(job->error);
}

}  // namespace vitrify::host

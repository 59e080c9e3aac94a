// dflash.cpp — the MPI job (see job.hpp) and the CPU backend's all-reduce across ranks.
//
// The host all-reduce across ranks (MpiHostGroup) keeps LocalCollectiveGroup's bits: element i
// becomes ((x_0[i] + x_1[i]) + x_2[i]) + … over the G global replicas in order. Within a rank
// the L replica threads post their buffers and meet at a barrier; local replica 0 (the leader)
// then runs a chain over the ranks, chunk by chunk: rank 0 sums its replicas' chunk in order and
// sends the partial sum to rank 1, which adds its replicas' values in order and passes it on, …;
// rank N−1 holds the sums, writes them into its buffers and broadcasts them to the others (the
// chunks pipeline: rank 0 sends chunk c+1 while rank 1 adds chunk c). Each link carries n values
// once, the broadcast n more: about the volume of a ring all-reduce, with N hops of latency. An
// MPI_Allreduce with MPI_SUM would not do: its summation order is the library's.
#include "train/job.hpp"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "core/error.hpp"

#ifdef DFLASH_HAVE_MPI
// The C API only: without these, mpi.h pulls in the deprecated C++ bindings, which need a library
// (libmpi_cxx) this build does not link.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace dflash {

#ifndef DFLASH_HAVE_MPI

std::shared_ptr<Job> job_init() {
  return nullptr;
}

#else

namespace {

using Clock = std::chrono::steady_clock;
using Lock = std::lock_guard<std::recursive_mutex>;

// Control-communicator tags.
enum Tag : int {
  kGather = 1,
  kBcast = 2,
  kStep = 3,
  kStatus = 4,
  kFail = 5,
  kStop = 6,
  kChain = 7
};

#define DFLASH_MPI_CHECK(call)                                                           \
  do {                                                                                   \
    const int _rc = (call);                                                              \
    if (_rc != MPI_SUCCESS) {                                                            \
      char _text[MPI_MAX_ERROR_STRING];                                                  \
      int _len = 0;                                                                      \
      MPI_Error_string(_rc, _text, &_len);                                               \
      fail("MPI error in {}: {}", #call, std::string(_text, static_cast<size_t>(_len))); \
    }                                                                                    \
  } while (0)

// Polls until `ready()` (which may make MPI calls); `check()` runs between polls and may throw.
// MPI moves a non-blocking message on only while the process calls into it, so the first 2 s
// poll with a bare yield (as MPI's own blocking calls spin); past that, the peer is slow, and
// the loop sleeps a millisecond between polls.
template <typename Ready, typename Check>
void poll_until(Ready ready, Check check) {
  const auto spin_until = Clock::now() + std::chrono::seconds(2);
  bool spinning = true;
  for (int i = 0;; ++i) {
    if (ready()) return;
    check();
    if (spinning && (i & 1023) == 1023) spinning = Clock::now() < spin_until;
    if (spinning) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

bool request_done(MPI_Request& r) {
  int done = 0;
  DFLASH_MPI_CHECK(MPI_Test(&r, &done, MPI_STATUS_IGNORE));
  return done != 0;
}

template <typename T>
MPI_Datatype mpi_type();
template <>
MPI_Datatype mpi_type<float>() {
  return MPI_FLOAT;
}
template <>
MPI_Datatype mpi_type<double>() {
  return MPI_DOUBLE;
}

// ------------------------------------------------------------------- the host all-reduce

class MpiHostGroup final : public CollectiveGroup,
                           public std::enable_shared_from_this<MpiHostGroup> {
 public:
  MpiHostGroup(MPI_Comm data, int rank, int ranks, int local)
      : data_(data),
        rank_(rank),
        ranks_(ranks),
        local_(local),
        barrier_(LocalCollectiveGroup::create(local)),
        buffers_(static_cast<size_t>(local), nullptr),
        sizes_(static_cast<size_t>(local), 0) {}
  int size() const override { return ranks_ * local_; }
  int local_size() const override { return local_; }
  std::string kind() const override { return fmt::format("mpi-host ({} ranks)", ranks_); }
  void abort(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!aborted_.load()) reason_ = reason;
      aborted_.store(true);
    }
    barrier_->abort(reason);
  }
  std::unique_ptr<Collective> host_member(int local) override;

  // Local replica `r`'s part of one all-reduce (see the file comment).
  template <typename T>
  void all_reduce(int r, T* data, int64_t n) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      buffers_[static_cast<size_t>(r)] = data;
      sizes_[static_cast<size_t>(r)] = n;
    }
    barrier_->barrier();
    for (size_t q = 1; q < sizes_.size(); ++q) {
      DFLASH_CHECK(sizes_[q] == sizes_[0], "collective: replica {} reduces {} values, replica 0 {}",
                   q, sizes_[q], sizes_[0]);
    }
    if (r == 0) {
      try {
        chain<T>(n);
      } catch (const std::exception& e) {
        abort(e.what());
        throw;
      }
    }
    barrier_->barrier();
  }

 private:
  void check_alive() {
    if (!aborted_.load()) return;
    std::lock_guard<std::mutex> lk(mu_);
    fail("collective aborted: {}", reason_);
  }
  void wait(MPI_Request& req) {
    poll_until([&] { return request_done(req); }, [&] { check_alive(); });
  }
  template <typename T>
  T* buffer(int q) {
    return static_cast<T*>(buffers_[static_cast<size_t>(q)]);
  }
  template <typename T>
  void chain(int64_t n);

  static constexpr int64_t kChainChunk = int64_t{1} << 18;  // values per chain message
  static constexpr int64_t kBcastChunk = int64_t{1} << 24;  // values per broadcast
  MPI_Comm data_;
  int rank_, ranks_, local_;
  std::shared_ptr<LocalCollectiveGroup> barrier_;
  std::mutex mu_;
  std::atomic<bool> aborted_{false};
  std::string reason_;
  std::vector<void*> buffers_;  // per local replica, during an all-reduce
  std::vector<int64_t> sizes_;
  // The leader's message buffers; members, so that requests left behind by an abort never
  // write into freed memory.
  std::vector<char> recv_, send_[2];
};

template <typename T>
void MpiHostGroup::chain(int64_t n) {
  const bool first = rank_ == 0, last = rank_ == ranks_ - 1;
  const auto chunk_bytes = static_cast<size_t>(kChainChunk) * sizeof(T);
  recv_.resize(chunk_bytes);
  for (auto& s : send_) s.resize(chunk_bytes);
  MPI_Request sends[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  for (int64_t begin = 0, c = 0; begin < n; begin += kChainChunk, ++c) {
    const int64_t m = std::min(kChainChunk, n - begin);
    T* partial = reinterpret_cast<T*>(recv_.data());
    T* out = reinterpret_cast<T*>(send_[c % 2].data());
    if (!last) wait(sends[c % 2]);  // its buffer is free again
    if (!first) {
      MPI_Request req;
      MPI_Status st;
      DFLASH_MPI_CHECK(
          MPI_Irecv(partial, static_cast<int>(m), mpi_type<T>(), rank_ - 1, kChain, data_, &req));
      poll_until(
          [&] {
            int done = 0;
            DFLASH_MPI_CHECK(MPI_Test(&req, &done, &st));
            return done != 0;
          },
          [&] { check_alive(); });
      int got = 0;
      MPI_Get_count(&st, mpi_type<T>(), &got);
      DFLASH_CHECK(got == m, "collective: rank {} sent {} values of a chunk of {}", rank_ - 1, got,
                   m);
    }
    for (int64_t i = 0; i < m; ++i) {
      T sum = first ? buffer<T>(0)[begin + i] : partial[i];
      for (int q = first ? 1 : 0; q < local_; ++q) sum += buffer<T>(q)[begin + i];
      if (last) {
        for (int q = 0; q < local_; ++q) buffer<T>(q)[begin + i] = sum;
      } else {
        out[i] = sum;
      }
    }
    if (!last) {
      DFLASH_MPI_CHECK(MPI_Isend(out, static_cast<int>(m), mpi_type<T>(), rank_ + 1, kChain, data_,
                                 &sends[c % 2]));
    }
  }
  for (auto& s : sends) wait(s);
  // The sums, from the last rank to every other.
  for (int64_t begin = 0; begin < n; begin += kBcastChunk) {
    const int64_t m = std::min(kBcastChunk, n - begin);
    MPI_Request req;
    DFLASH_MPI_CHECK(MPI_Ibcast(buffer<T>(0) + begin, static_cast<int>(m), mpi_type<T>(),
                                ranks_ - 1, data_, &req));
    wait(req);
  }
  if (!last) {
    for (int q = 1; q < local_; ++q) std::memcpy(buffer<T>(q), buffer<T>(0), n * sizeof(T));
  }
}

class MpiHostMember final : public Collective {
 public:
  MpiHostMember(std::shared_ptr<MpiHostGroup> group, int local)
      : group_(std::move(group)), r_(local) {}
  int rank() const override { return r_; }
  int size() const override { return group_->size(); }
  void all_reduce_sum(float* data, int64_t n) override { group_->all_reduce(r_, data, n); }
  void all_reduce_sum_host(std::span<double> values) override {
    group_->all_reduce(r_, values.data(), static_cast<int64_t>(values.size()));
  }
  std::string describe() const override {
    return fmt::format("{}, {} replicas in all, host memory", group_->kind(), group_->size());
  }

 private:
  std::shared_ptr<MpiHostGroup> group_;
  int r_;
};

std::unique_ptr<Collective> MpiHostGroup::host_member(int local) {
  DFLASH_CHECK(local >= 0 && local < local_, "collective: local replica {} outside {}", local,
               local_);
  return std::make_unique<MpiHostMember>(shared_from_this(), local);
}

// ------------------------------------------------------------------------------- the job

// Messages in flight from this rank (their buffers live until the send completes).
struct Outbox {
  std::deque<std::pair<std::vector<char>, MPI_Request> > sends;
  void reap() {
    while (!sends.empty() && request_done(sends.front().second)) sends.pop_front();
  }
};

void pack(std::vector<double>& out, const ReplicaStepFigures& f) {
  const ObjectiveMetrics& m = f.metrics;
  out.insert(out.end(), {f.grad_norm, static_cast<double>(f.skip), static_cast<double>(f.tokens),
                         static_cast<double>(f.supervised), m.loss_weighted_sum, m.weight_sum,
                         m.accept_len_sum, static_cast<double>(m.blocks),
                         static_cast<double>(m.K)});
  for (int64_t v : m.slot_correct) out.push_back(static_cast<double>(v));
  for (int64_t v : m.slot_count) out.push_back(static_cast<double>(v));
  out.insert(out.end(), {m.dspark ? 1.0 : 0.0, m.dspark_ce_sum, m.dspark_l1_sum, m.dspark_bce_sum,
                         m.dspark_acc_sum});
  out.insert(out.end(), {m.domino ? 1.0 : 0.0, m.domino_final_ce_sum, m.domino_base_ce_sum});
}

ReplicaStepFigures unpack(const std::vector<double>& in, size_t& at, int from) {
  auto next = [&] {
    DFLASH_CHECK(at < in.size(), "rank {}: a truncated step message ({} values)", from, in.size());
    return in[at++];
  };
  ReplicaStepFigures f;
  f.grad_norm = next();
  f.skip = static_cast<int>(next());
  f.tokens = static_cast<int64_t>(next());
  f.supervised = static_cast<int64_t>(next());
  const double loss_weighted_sum = next(), weight_sum = next(), accept_len_sum = next();
  const auto blocks = static_cast<int64_t>(next());
  ObjectiveMetrics& m = f.metrics = ObjectiveMetrics(static_cast<int>(next()));
  m.loss_weighted_sum = loss_weighted_sum;
  m.weight_sum = weight_sum;
  m.accept_len_sum = accept_len_sum;
  m.blocks = blocks;
  for (int64_t& v : m.slot_correct) v = static_cast<int64_t>(next());
  for (int64_t& v : m.slot_count) v = static_cast<int64_t>(next());
  m.dspark = next() != 0.0;
  m.dspark_ce_sum = next();
  m.dspark_l1_sum = next();
  m.dspark_bce_sum = next();
  m.dspark_acc_sum = next();
  m.domino = next() != 0.0;
  m.domino_final_ce_sum = next();
  m.domino_base_ce_sum = next();
  return f;
}

class MpiJob final : public Job {
 public:
  MpiJob(int rank, int size) : rank_(rank), size_(size) {
    DFLASH_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &control_));
    DFLASH_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &data_));
    statuses_.assign(static_cast<size_t>(size), "");
    status_counts_.assign(static_cast<size_t>(size), 0);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  std::vector<std::string> gather(const std::string& mine, double timeout_s) override {
    Lock lk(mu_);
    if (rank_ != 0) {
      // The count of status snapshots sent first: rank 0 takes them all before it answers, so
      // that no send of this rank is left pending at MPI_Finalize.
      std::string msg = fmt::format("{}\n", status_sent_) + mine;
      MPI_Request req;
      DFLASH_MPI_CHECK(MPI_Isend(msg.data(), static_cast<int>(msg.size()), MPI_CHAR, 0, kGather,
                                 control_, &req));
      poll_until([&] { return request_done(req); }, [] {});
      return {};
    }
    std::vector<std::string> all(static_cast<size_t>(size_));
    all[0] = mine;
    for (int k = 1; k < size_; ++k) {
      std::string msg = receive_from(k, kGather, timeout_s, "the end-of-run exchange");
      const size_t nl = msg.find('\n');
      DFLASH_CHECK(nl != std::string::npos, "rank {}: a malformed gather message", k);
      const int64_t sent = std::stoll(msg.substr(0, nl));
      while (status_counts_[static_cast<size_t>(k)] < sent) {
        statuses_[static_cast<size_t>(k)] =
            receive_from(k, kStatus, timeout_s, "a status snapshot");
        ++status_counts_[static_cast<size_t>(k)];
      }
      all[static_cast<size_t>(k)] = msg.substr(nl + 1);
    }
    return all;
  }

  std::string broadcast(const std::string& text) override {
    Lock lk(mu_);
    if (rank_ == 0) {
      std::vector<MPI_Request> reqs(static_cast<size_t>(size_ - 1));
      for (int k = 1; k < size_; ++k) {
        DFLASH_MPI_CHECK(MPI_Isend(text.data(), static_cast<int>(text.size()), MPI_CHAR, k, kBcast,
                                   control_, &reqs[static_cast<size_t>(k - 1)]));
      }
      for (MPI_Request& r : reqs) poll_until([&] { return request_done(r); }, [] {});
      return text;
    }
    return receive_from(0, kBcast, 0, "rank 0's broadcast");
  }

  std::shared_ptr<CollectiveGroup> host_collective(int local) override {
    return std::make_shared<MpiHostGroup>(data_, rank_, size_, local);
  }

  void send_step(int64_t step, const std::vector<ReplicaStepFigures>& replicas) override {
    std::vector<double> v = {static_cast<double>(step), static_cast<double>(replicas.size())};
    for (const ReplicaStepFigures& f : replicas) pack(v, f);
    std::vector<char> bytes(v.size() * sizeof(double));
    std::memcpy(bytes.data(), v.data(), bytes.size());
    send(std::move(bytes), kStep);
  }

  std::vector<ReplicaStepFigures> receive_step(int64_t step, int replicas_per_rank,
                                               double timeout_s) override {
    Lock lk(mu_);
    std::vector<ReplicaStepFigures> out;
    for (int k = 1; k < size_; ++k) {
      const std::string msg =
          receive_from(k, kStep, timeout_s, fmt::format("the figures of step {}", step + 1));
      std::vector<double> v(msg.size() / sizeof(double));
      std::memcpy(v.data(), msg.data(), v.size() * sizeof(double));
      DFLASH_CHECK(v.size() >= 2 && static_cast<int64_t>(v[0]) == step &&
                       static_cast<int>(v[1]) == replicas_per_rank,
                   "rank {} sent the figures of step {} ({} replicas) while rank 0 finished step "
                   "{} ({} replicas per rank)",
                   k, v.empty() ? -1 : static_cast<int64_t>(v[0]) + 1, v.size() < 2 ? 0 : v[1],
                   step + 1, replicas_per_rank);
      size_t at = 2;
      for (int r = 0; r < replicas_per_rank; ++r) out.push_back(unpack(v, at, k));
    }
    return out;
  }

  void send_status(const std::string& json_text) override {
    Lock lk(mu_);
    outbox_.reap();
    if (status_req_ != MPI_REQUEST_NULL && !request_done(status_req_)) return;
    status_buf_.assign(json_text.begin(), json_text.end());
    DFLASH_MPI_CHECK(MPI_Isend(status_buf_.data(), static_cast<int>(status_buf_.size()), MPI_CHAR,
                               0, kStatus, control_, &status_req_));
    ++status_sent_;
  }

  std::vector<std::string> statuses() override {
    Lock lk(mu_);
    for (;;) {
      int flag = 0;
      MPI_Status st;
      DFLASH_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kStatus, control_, &flag, &st));
      if (!flag) break;
      const auto k = static_cast<size_t>(st.MPI_SOURCE);
      statuses_[k] = receive_probed(st, kStatus);
      ++status_counts_[k];
    }
    return statuses_;
  }

  std::optional<std::pair<int, std::string> > peer_failure() override {
    Lock lk(mu_);
    poll_failure();
    return failure_;
  }

  void announce_stop(int64_t stop_before) override {
    for (int k = 1; k < size_; ++k) {
      std::vector<char> bytes(sizeof stop_before);
      std::memcpy(bytes.data(), &stop_before, sizeof stop_before);
      send(std::move(bytes), kStop, k);
    }
  }

  std::optional<int64_t> stop_announced() override {
    Lock lk(mu_);
    if (!stop_) {
      int flag = 0;
      MPI_Status st;
      DFLASH_MPI_CHECK(MPI_Iprobe(0, kStop, control_, &flag, &st));
      if (flag) {
        const std::string msg = receive_probed(st, kStop);
        DFLASH_CHECK(msg.size() == sizeof(int64_t), "rank 0 sent a malformed stop step");
        int64_t v = 0;
        std::memcpy(&v, msg.data(), sizeof v);
        stop_ = v;
      }
    }
    return stop_;
  }

  void report_failure(const std::string& message) override {
    Lock lk(mu_);
    if (rank_ == 0 || reported_) return;
    reported_ = true;
    fail_buf_.assign(message.begin(), message.end());
    DFLASH_MPI_CHECK(MPI_Isend(fail_buf_.data(), static_cast<int>(fail_buf_.size()), MPI_CHAR, 0,
                               kFail, control_, &fail_req_));
  }

  [[noreturn]] void fail_and_abort(const std::string& message, double grace_s) override {
    std::fflush(stdout);
    std::fprintf(stderr, "dflash: error (rank %d of %d): %s\n", rank_, size_, message.c_str());
    std::fflush(stderr);
    if (rank_ != 0) {
      try {  // named by rank (worker names already carry it: "rank1/drafter0 ...")
        report_failure(message.rfind(name() + "/", 0) == 0 ? message : name() + ": " + message);
      } catch (const std::exception&) {
      }
      // Rank 0 logs the failure, stops its workers, checkpoints and aborts the job; this rank
      // ends it itself only when that does not come.
      const auto until = Clock::now() + std::chrono::duration<double>(grace_s);
      while (Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);
  }

  void finish() override {
    {
      Lock lk(mu_);
      poll_until(
          [&] {
            outbox_.reap();
            return outbox_.sends.empty() &&
                   (status_req_ == MPI_REQUEST_NULL || request_done(status_req_));
          },
          [] {});
      MPI_Comm_free(&control_);
      MPI_Comm_free(&data_);
    }
    MPI_Finalize();
  }

 private:
  void send(std::vector<char> bytes, int tag, int to = 0) {
    Lock lk(mu_);
    outbox_.reap();
    outbox_.sends.emplace_back(std::move(bytes), MPI_REQUEST_NULL);
    auto& [buf, req] = outbox_.sends.back();
    DFLASH_MPI_CHECK(
        MPI_Isend(buf.data(), static_cast<int>(buf.size()), MPI_CHAR, to, tag, control_, &req));
  }

  // Rank 0: a failure report of another rank, kept once seen (mu_ held).
  void poll_failure() {
    if (rank_ != 0 || failure_) return;
    int flag = 0;
    MPI_Status st;
    DFLASH_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kFail, control_, &flag, &st));
    if (!flag) return;
    failure_.emplace(st.MPI_SOURCE, receive_probed(st, kFail));
  }

  std::string receive_probed(MPI_Status& st, int tag) {
    int n = 0;
    MPI_Get_count(&st, MPI_CHAR, &n);
    std::string text(static_cast<size_t>(n), '\0');
    DFLASH_MPI_CHECK(
        MPI_Recv(text.data(), n, MPI_CHAR, st.MPI_SOURCE, tag, control_, MPI_STATUS_IGNORE));
    return text;
  }

  // The next message of `tag` from rank `from` (mu_ held). Rank 0 watches the failure reports
  // meanwhile; timeout_s > 0 bounds the wait. A message its sender sent before a failure report
  // is still taken (Open MPI matches a peer's messages on a communicator in the order sent, so
  // once the report is visible, so is what came before it).
  std::string receive_from(int from, int tag, double timeout_s, const std::string& what) {
    const auto start = Clock::now();
    MPI_Status st;
    auto arrived = [&] {
      int flag = 0;
      DFLASH_MPI_CHECK(MPI_Iprobe(from, tag, control_, &flag, &st));
      return flag != 0;
    };
    poll_until(arrived, [&] {
      poll_failure();
      // Arrived meanwhile: the next poll takes it.
      if (failure_ && !arrived()) fail("{}", failure_->second);
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      DFLASH_CHECK(timeout_s <= 0 || waited < timeout_s,
                   "rank {} did not send {} within {:.0f} s (runtime.stall_timeout_s): it is "
                   "stuck or cut off",
                   from, what, timeout_s);
    });
    return receive_probed(st, tag);
  }

  int rank_, size_;
  MPI_Comm control_ = MPI_COMM_NULL, data_ = MPI_COMM_NULL;
  std::recursive_mutex mu_;
  Outbox outbox_;
  std::vector<char> status_buf_, fail_buf_;
  MPI_Request status_req_ = MPI_REQUEST_NULL, fail_req_ = MPI_REQUEST_NULL;
  int64_t status_sent_ = 0;
  std::vector<std::string> statuses_;
  std::vector<int64_t> status_counts_;
  std::optional<std::pair<int, std::string> > failure_;
  std::optional<int64_t> stop_;
  bool reported_ = false;
};

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

}  // namespace

std::shared_ptr<Job> job_init() {
  if (!launched_by_mpi()) return nullptr;
  int provided = 0;
  DFLASH_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size == 1) {
    std::atexit([] { MPI_Finalize(); });
    return nullptr;
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    std::fprintf(stderr,
                 "dflash: error (rank %d): the MPI library gives thread level %d, below "
                 "MPI_THREAD_MULTIPLE (%d), which `dflash train` needs (a replica thread and the "
                 "coordinating thread call MPI at the same time)\n",
                 rank, provided, MPI_THREAD_MULTIPLE);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return std::make_shared<MpiJob>(rank, size);
}

#endif  // DFLASH_HAVE_MPI

}  // namespace dflash

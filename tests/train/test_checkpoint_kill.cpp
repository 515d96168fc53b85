// Trainer checkpoints are atomic: a run killed with SIGKILL at any moment leaves the previous
// checkpoints or the new one under a checkpoint's name, never a malformed file, and the next
// run resumes from last.safetensors where the killed one stopped. The writer is a child
// process (tests/train/checkpoint_writer.cpp, whose path the build gives as
// LAZYTENSOR_CHECKPOINT_WRITER) that saves at every step, creating and removing files; it
// is killed at random moments (a fixed seed) over several runs, and after each kill every
// *.safetensors file of the directory must load as a Trainer checkpoint.

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <lazytensor/io.hpp>

#include "trainer_testing.hpp"

extern char** environ;

namespace checkpoint_kill_test {

using Clock = std::chrono::steady_clock;

/// The integer `text` holds in full, or nullopt.
inline std::optional<std::int64_t> parse_integer(const std::string& text) {
  std::int64_t v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || r.ec != std::errc() || r.ptr != text.data() + text.size()) return std::nullopt;
  return v;
}

inline bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// What the writer reported on stderr (see checkpoint_writer.cpp): the step it started at,
/// when (ms after its start), and the saves it completed.
struct ChildReport {
  std::optional<std::int64_t> start_step;
  long long start_ms = -1;
  std::vector<std::int64_t> saved_steps;
  std::vector<long long> saved_ms;
};

inline ChildReport parse_report(const std::string& text) {
  ChildReport r;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string what, step, ms;
    if (!(words >> what >> step >> ms)) continue;  // a line cut by the kill
    const auto s = parse_integer(step), t = parse_integer(ms);
    if (!s || !t) continue;
    if (what == "start") {
      r.start_step = *s;
      r.start_ms = *t;
    } else if (what == "saved") {
      r.saved_steps.push_back(*s);
      r.saved_ms.push_back(*t);
    }
  }
  return r;
}

/// A spawned writer; killed and reaped on destruction if the test leaves early.
struct Child {
  pid_t pid = -1;
  bool reaped = false;
  int status = 0;
  Child() = default;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() {
    if (pid > 0 && !reaped) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
  }
  /// Whether it has exited (reaping it).
  bool exited() {
    if (reaped) return true;
    pid_t r;
    do r = ::waitpid(pid, &status, WNOHANG);
    while (r < 0 && errno == EINTR);
    if (r == pid) reaped = true;
    return reaped;
  }
  /// SIGKILL, then reap.
  void kill_and_wait() {
    if (reaped) return;
    ::kill(pid, SIGKILL);
    pid_t r;
    do r = ::waitpid(pid, &status, 0);
    while (r < 0 && errno == EINTR);
    reaped = r == pid;
  }
};

/// Starts `exe dir --progress` with stdout and stderr going to `log`; an error message, or
/// "" when it started.
inline std::string spawn_writer(Child& child, const std::string& exe, const std::string& dir, const std::string& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 2, 1);
  std::string a0 = exe, a1 = dir, a2 = "--progress";
  char* argv[] = {a0.data(), a1.data(), a2.data(), nullptr};
  const int rc = ::posix_spawn(&child.pid, exe.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    child.pid = -1;
    return "posix_spawn '" + exe + "': " + std::strerror(rc);
  }
  return "";
}

inline std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + std::to_string(WTERMSIG(status));
  return "status " + std::to_string(status);
}

/// The global_step of the checkpoint at `path` after checking that it loads as a Trainer
/// checkpoint; nullopt (and a test failure naming the file) otherwise.
inline std::optional<std::int64_t> checked_step(const std::string& path, int run) {
  lazy::StateDict sd;
  try {
    sd = lazy::io::load(path);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "after run " << run << ": '" << path << "' does not load: " << e.what();
    return std::nullopt;
  }
  const auto& meta = sd.metadata();
  EXPECT_TRUE(meta.count("lazytensor.checkpoint")) << "after run " << run << ": " << path;
  EXPECT_TRUE(sd.contains("state_dict.fc1.weight") && sd.contains("state_dict.fc2.bias"))
      << "after run " << run << ": " << path << " lacks the module's parameters";
  const auto it = meta.find("global_step");
  if (it == meta.end()) {
    ADD_FAILURE() << "after run " << run << ": " << path << " has no \"global_step\" metadata";
    return std::nullopt;
  }
  const auto step = parse_integer(it->second);
  if (!step || *step < 0) {
    ADD_FAILURE() << "after run " << run << ": " << path << " has global_step \"" << it->second << "\"";
    return std::nullopt;
  }
  return step;
}

constexpr const char* kExtension = ".safetensors";

/// Checks every file of `dir` after run `run`; the global_step of last.safetensors if it
/// is there. `temp_files` counts the atomic writer's leftovers.
inline std::optional<std::int64_t> check_directory(const std::string& dir, int run, int& checkpoints, int& temp_files) {
  std::optional<std::int64_t> last_step;
  checkpoints = temp_files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const std::string path = dir + "/" + name;
    if (!ends_with(name, kExtension)) {
      // Only a killed AtomicFileWriter's temporary file ("." + target name + ".tmp." ...) may
      // be left next to the checkpoints.
      EXPECT_TRUE(name.front() == '.' && name.find(std::string(kExtension) + ".tmp.") != std::string::npos)
          << "after run " << run << ": unexpected file '" << name << "' in " << dir;
      ++temp_files;
      continue;
    }
    ++checkpoints;
    const auto step = checked_step(path, run);
    if (!step) continue;
    if (name == std::string("last") + kExtension) {
      last_step = step;
      continue;
    }
    // The other files are ModelCheckpoint's "epoch=E-step=S": S is the file's global_step.
    const auto at = name.find("-step=");
    const auto s = at == std::string::npos
                       ? std::nullopt
                       : parse_integer(name.substr(at + 6, name.size() - at - 6 - std::strlen(kExtension)));
    EXPECT_TRUE(name.rfind("epoch=", 0) == 0 && s) << "after run " << run << ": unexpected checkpoint name '" << name << "'";
    if (s) {
      EXPECT_EQ(*step, *s) << "after run " << run << ": '" << name << "' holds another step";
    }
  }
  return last_step;
}

/// Kills writers of one directory `runs` times at random moments and checks the directory
/// after each kill.
inline void run_kills(const std::string& exe, int runs) {
  const std::string dir = trainer_testing::temp_dir("checkpoint_kill");
  const std::string logs = trainer_testing::temp_dir("checkpoint_kill_logs");
  SCOPED_TRACE("checkpoints in " + dir + ", the writers' output in " + logs);
  std::mt19937 rng(20240611u);
  std::uniform_int_distribution<int> sleep_ms(100, 600);
  std::optional<std::int64_t> last_step;  // of last.safetensors after the previous run
  std::int64_t first_last_step = -1;
  long long total_saves = 0;
  for (int run = 0; run < runs; ++run) {
    const std::string log = logs + "/run" + std::to_string(run) + ".log";
    Child child;
    const auto spawned = Clock::now();
    const std::string error = spawn_writer(child, exe, dir, log);
    ASSERT_EQ(error, "");
    // Wait until the child trains (start and resume take 5-25 ms at -O1 on a 2-core machine, longer
    // under load or sanitizers), then let it save for 100-600 ms (a save every 10-15 ms
    // here) and kill it wherever it is.
    bool started = false;
    while (Clock::now() - spawned < std::chrono::seconds(120)) {
      started = parse_report(read_text(log)).start_step.has_value();
      if (started || child.exited()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_TRUE(started) << "run " << run << ": the writer did not start training ("
                         << (child.reaped ? describe_status(child.status) : std::string("still running after 120 s"))
                         << "); its output:\n"
                         << read_text(log);
    const auto start_seen_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - spawned).count();
    const int wait = sleep_ms(rng);
    std::this_thread::sleep_for(std::chrono::milliseconds(wait));
    ASSERT_FALSE(child.exited()) << "run " << run << ": the writer " << describe_status(child.status)
                                 << " before it was killed; its output:\n"
                                 << read_text(log);
    child.kill_and_wait();
    ASSERT_TRUE(child.reaped);
    EXPECT_TRUE(WIFSIGNALED(child.status) && WTERMSIG(child.status) == SIGKILL) << describe_status(child.status);

    const ChildReport report = parse_report(read_text(log));
    // Each run resumes from the last.safetensors the previous one left (step 0 without one).
    EXPECT_EQ(report.start_step.value_or(-1), last_step.value_or(0)) << "run " << run << " did not resume from last.safetensors";
    int checkpoints = 0, temp_files = 0;
    const auto step = check_directory(dir, run, checkpoints, temp_files);
    if (last_step) {
      ASSERT_TRUE(step.has_value()) << "after run " << run << ": last.safetensors is gone or broken";
      EXPECT_GE(*step, *last_step) << "after run " << run << ": last.safetensors went back";
    }
    if (step && first_last_step < 0) first_last_step = *step;
    if (step) last_step = step;
    total_saves += static_cast<long long>(report.saved_steps.size());
    std::printf("[ run %d ] started at step %lld (%lld ms after its main, seen %lld ms after the spawn); %zu saves "
                "(first %lld ms after its main); killed %d ms after the start; last.safetensors at step %s; %d checkpoint "
                "files, %d temporary files\n",
                run, static_cast<long long>(report.start_step.value_or(-1)), report.start_ms,
                static_cast<long long>(start_seen_ms), report.saved_steps.size(),
                report.saved_ms.empty() ? -1LL : report.saved_ms.front(), wait,
                step ? std::to_string(*step).c_str() : "-", checkpoints, temp_files);
  }
  ASSERT_TRUE(last_step.has_value()) << "no run wrote last.safetensors (" << total_saves << " saves reported)";
  EXPECT_GT(*last_step, first_last_step) << "last.safetensors never advanced over " << runs << " runs";
  // (Both live in the scratch directory: removed at exit, or kept with its path printed when
  // a test failed.)
}

}  // namespace checkpoint_kill_test

TEST(TrainerCheckpoints, KilledWritersLeaveOnlyCompleteCheckpoints) {
#ifndef LAZYTENSOR_CHECKPOINT_WRITER
  FAIL() << "built without LAZYTENSOR_CHECKPOINT_WRITER, the path of the lazytensor_checkpoint_writer program "
            "(tests/CMakeLists.txt defines it for test_train)";
#else
  checkpoint_kill_test::run_kills(LAZYTENSOR_CHECKPOINT_WRITER, 10);
#endif
}

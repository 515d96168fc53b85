#pragma once
// POSIX file access for the readers and writers of lazy::io and lazy::data: every system
// call is checked and turned into an IoError naming the file and the OS reason, partial
// reads/writes and EINTR are retried, and writes replace their target atomically.

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>

namespace lazy::io::detail {

/// The OS description of `err` (thread-safe, unlike strerror).
inline std::string os_reason(int err) {
  return std::error_code(err, std::generic_category()).message();
}

/// An IoError "<what> '<path>': <reason of errno>".
IoError os_error(const std::string& what, const std::string& path, int err = errno);

/// The directory part of `path` ("." when it has none), for temp files and directory fsync.
std::string parent_dir(const std::string& path);

/// Creates directory `path` and its missing parents (mkdir -p); IoError naming the first
/// one that cannot be created.
void make_directories(const std::string& path);

/// The names in directory `path` (without "." and ".."), or nothing when it does not exist;
/// IoError when it exists but cannot be read.
std::vector<std::string> list_directory(const std::string& path);

/// Whether `path` names an existing file or directory.
bool path_exists(const std::string& path);

/// A file opened for reading, with its size taken once at open.
class ReadFile {
 public:
  /// Opens `path`; IoError when it cannot be opened or is not a regular file.
  explicit ReadFile(std::string path);
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;
  ~ReadFile() { ::close(fd_); }

  const std::string& path() const { return path_; }
  /// Size in bytes when the file was opened.
  std::uint64_t size() const { return size_; }

  /// Reads up to `n` bytes at the current position; fewer only at end of file.
  std::size_t read(void* dst, std::size_t n);

  /// Reads up to `n` bytes at byte `offset` (the position is not moved); fewer only at end
  /// of file.
  std::size_t read_at(void* dst, std::size_t n, std::uint64_t offset);

 private:
  std::string path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

/// Writes a file atomically: the bytes go to a temporary file in the target's directory,
/// which commit() fsyncs and renames over the target, then fsyncs the directory (so the
/// rename itself survives a crash). Until commit() succeeds the target is untouched; a
/// writer destroyed without commit (an exception on the way) removes its temporary file.
class AtomicFileWriter {
 public:
  /// Creates the temporary file; IoError when the directory refuses it.
  explicit AtomicFileWriter(std::string path);
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter() { discard(); }

  /// Path of the temporary file (for tests and messages).
  const std::string& temp_path() const { return tmp_; }

  /// Appends `n` bytes; IoError (and the temporary file removed) on failure.
  void write(const void* src, std::size_t n);

  /// Makes the written bytes the content of the target path (fsync, rename, directory fsync).
  void commit();

 private:
  [[noreturn]] void fail(const std::string& what);
  void discard() noexcept;

  std::string path_;
  std::string tmp_;
  int fd_ = -1;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE IoError os_error(const std::string& what, const std::string& path, int err) {
  return IoError(what + " '" + path + "': " + os_reason(err));
}

LAZYTENSOR_INLINE std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

LAZYTENSOR_INLINE void make_directories(const std::string& path) {
  if (path.empty()) return;
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    const std::string part = path.substr(0, pos);
    if (part.empty() || part == "/") continue;
    if (::mkdir(part.c_str(), 0777) != 0 && errno != EEXIST) throw os_error("cannot create directory", part);
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw IoError("cannot create directory '" + path + "': a file of that name exists");
}

LAZYTENSOR_INLINE std::vector<std::string> list_directory(const std::string& path) {
  std::vector<std::string> names;
  DIR* d = ::opendir(path.c_str());
  if (!d) {
    if (errno == ENOENT) return names;
    throw os_error("cannot list directory", path);
  }
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  return names;
}

LAZYTENSOR_INLINE bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

LAZYTENSOR_INLINE ReadFile::ReadFile(std::string path) : path_(std::move(path)) {
  do fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  while (fd_ < 0 && errno == EINTR);
  if (fd_ < 0) throw os_error("cannot open", path_);
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    throw os_error("cannot stat", path_, err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw IoError("cannot read '" + path_ + "': not a regular file");
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
}

LAZYTENSOR_INLINE std::size_t ReadFile::read(void* dst, std::size_t n) {
  std::size_t done = 0;
  while (done < n) {
    const ::ssize_t r = ::read(fd_, static_cast<char*>(dst) + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw os_error("cannot read", path_);
    if (r == 0) break;
    done += static_cast<std::size_t>(r);
  }
  return done;
}

LAZYTENSOR_INLINE std::size_t ReadFile::read_at(void* dst, std::size_t n, std::uint64_t offset) {
  std::size_t done = 0;
  while (done < n) {
    const ::ssize_t r = ::pread(fd_, static_cast<char*>(dst) + done, n - done,
                                static_cast<::off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw os_error("cannot read", path_);
    if (r == 0) break;
    done += static_cast<std::size_t>(r);
  }
  return done;
}

LAZYTENSOR_INLINE AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  const auto slash = path_.find_last_of('/');
  const std::string dir = slash == std::string::npos ? std::string() : path_.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? path_ : path_.substr(slash + 1);
  if (base.empty())
    throw IoError("cannot write '" + path_ + "': the path names a directory, not a file");
  // A hidden name unique to this process, call and moment; O_EXCL makes a clash an error
  // we retry rather than a file we clobber. 0666 lets the umask decide, as for any file.
  static std::atomic<std::uint64_t> counter{0};
  for (int attempt = 0;; ++attempt) {
    const auto stamp =
        static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    tmp_ = dir + "." + base + ".tmp." + std::to_string(::getpid()) + "." +
           std::to_string(counter.fetch_add(1)) + "." + std::to_string(stamp % 1000000007u);
    do fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    while (fd_ < 0 && errno == EINTR);
    if (fd_ >= 0) break;
    if (errno != EEXIST || attempt == 16)
      throw os_error("cannot create a temporary file next to", path_);
  }
}

LAZYTENSOR_INLINE void AtomicFileWriter::write(const void* src, std::size_t n) {
  std::size_t done = 0;
  while (done < n) {
    const ::ssize_t r = ::write(fd_, static_cast<const char*>(src) + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail("cannot write");
    done += static_cast<std::size_t>(r);
  }
}

LAZYTENSOR_INLINE void AtomicFileWriter::commit() {
  if (::fsync(fd_) != 0) fail("cannot flush (fsync)");
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) fail("cannot close");
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail("cannot rename the temporary file over");
  tmp_.clear();  // it is the target now
  // The rename is durable only once the directory entry is on disk. The data is already
  // safe and the target replaced, so a directory that cannot be opened (some filesystems)
  // is not an error; a failing fsync is.
  const std::string dir = parent_dir(path_);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    const int rc = ::fsync(dfd);
    const int err = errno;
    ::close(dfd);
    if (rc != 0 && err != EINVAL && err != EROFS)
      throw os_error("cannot flush (fsync) the directory of", path_, err);
  }
}

LAZYTENSOR_INLINE void AtomicFileWriter::fail(const std::string& what) {
  const int err = errno;
  discard();
  throw os_error(what, path_, err);
}

LAZYTENSOR_INLINE void AtomicFileWriter::discard() noexcept {
  if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  if (!tmp_.empty()) ::unlink(std::exchange(tmp_, std::string()).c_str());
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::io::detail

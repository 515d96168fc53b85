#pragma once
// Error hierarchy. Every failure reachable from the public API is one of these, with a
// message that says what was expected, what was found, and where.

#include <exception>
#include <stdexcept>
#include <string>

#include <lazytensor/core/config.hpp>

namespace lazy {

/// Base of every lazytensor error.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// Incompatible or invalid shapes, out-of-range dimensions.
class ShapeError : public Error {
 public:
  using Error::Error;
};

/// An op was given a dtype it does not support.
class DTypeError : public Error {
 public:
  using Error::Error;
};

/// An index value (gather, index_select, one_hot, ...) is out of range.
class IndexError : public Error {
 public:
  using Error::Error;
};

/// Tensors on different devices, or an unknown device.
class DeviceError : public Error {
 public:
  using Error::Error;
};

/// Invalid sharding annotation.
class ShardingError : public Error {
 public:
  using Error::Error;
};

/// Base of collective failures.
class CollectiveError : public Error {
 public:
  using Error::Error;
};

/// Replicas issued different collectives at the same sequence number.
class CollectiveMismatch : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

/// A participant did not arrive in time.
class CollectiveTimeout : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

/// Another replica failed; this one was woken up to stop.
class ReplicaAborted : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

/// Malformed or truncated file contents.
class FormatError : public Error {
 public:
  using Error::Error;
};

/// The operating system refused a file operation.
class IoError : public Error {
 public:
  using Error::Error;
};

/// Memory for a buffer could not be had: more than the machine holds, or the allocator
/// refused (torch.OutOfMemoryError). Names the size asked for.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

namespace detail {

/// The message of a caught exception: what() of a std::exception, else a placeholder.
std::string exception_message(const std::exception_ptr& e);

}  // namespace detail

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {

LAZYTENSOR_INLINE std::string exception_message(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}

}  // namespace lazy::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

#pragma once
// train::SingleDeviceStrategy, Lightning's: one replica on one device. Collectives return
// their input (a world of one), launch() runs on the calling thread with the strategy's
// device as the thread's device.

#include <string>

#include <lazytensor/core/config.hpp>
#include <lazytensor/train/strategy.hpp>

namespace lazy::train {

/// Training on one device (Lightning's SingleDeviceStrategy).
class SingleDeviceStrategy : public Strategy {
 public:
  /// On `device` (default: the calling thread's device).
  explicit SingleDeviceStrategy(Device device = lazy::device()) : device_(device) {}

  Device root_device() const override { return device_; }
  int num_processes() const override { return 1; }
  bool is_distributed() const override { return false; }

 private:
  Device device_;
};

}  // namespace lazy::train

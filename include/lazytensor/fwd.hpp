#pragma once
// Declarations of lazytensor's user-facing types, for a user's own headers: a header that
// only names `lazy::Tensor<float>` in a signature includes this (as nlohmann's json_fwd.hpp)
// and leaves the definitions, and their compile time, to the source files that use them.
// It costs <cstdint>, <string> and <ostream> (through the element types), nothing else.

#include <lazytensor/core/dtype.hpp>  // DType, Element, bfloat16: a concept cannot be declared ahead

namespace lazy {

class Shape;
class Device;
template <Element T>
class Tensor;
class AnyTensor;
class StateDict;
struct Size2;

enum class ReduceOp;

class AutocastGuard;

class Error;
class ShapeError;
class DTypeError;
class IndexError;
class DeviceError;
class ShardingError;
class CollectiveError;
class CollectiveMismatch;
class CollectiveTimeout;
class ReplicaAborted;
class FormatError;
class IoError;
class OutOfMemoryError;

namespace nn {
class Module;
template <class Impl>
class ModuleHolder;
}  // namespace nn

namespace optim {
class Optimizer;
}  // namespace optim

namespace spmd {
class Mesh;
class HybridMesh;
class ShardingSpec;
}  // namespace spmd

namespace train {
class Strategy;
class SingleDeviceStrategy;
template <class>
class BasicReplicaStrategy;
using ReplicaStrategy = BasicReplicaStrategy<void>;
class Precision;
class DoublePrecision;
class HalfPrecision;
class MixedPrecision;
class Accelerator;
class CPUAccelerator;
}  // namespace train

}  // namespace lazy

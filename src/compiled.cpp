// lazytensor::compiled: the one translation unit that defines the non-template runtime
// (device, executor, planner, pools, thread pool, collectives' transport, file and format
// readers). Users linking the target compile with LAZYTENSOR_COMPILED, so their headers
// only declare these parts. See include/lazytensor/core/config.hpp.
#define LAZYTENSOR_BUILDING_RUNTIME
#include <lazytensor/lazytensor.hpp>

// The instruction set this library's kernels were compiled for; user TUs refer to the symbol
// named after theirs (core/config.hpp), so a program built for another one does not link.
extern "C" const char LAZYTENSOR_ISA_SYMBOL(LAZYTENSOR_ISA) = 1;

// The per-dtype templates that user TUs declare `extern template` (core/config.hpp), defined
// here after every header, so that each definition sees everything it calls.
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NODE_OPS_INSTANCES, )
LAZYTENSOR_FOR_ELEMENT(LAZYTENSOR_SHAPE_HELPERS_INSTANCES, )
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_REDUCTION_INSTANCES, )
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_RANDOM_INSTANCES, )
LAZYTENSOR_RANDINT_INSTANCES(, std::int32_t)
LAZYTENSOR_RANDINT_INSTANCES(, std::int64_t)
LAZYTENSOR_EIGEN_GEMM_ADD_NT_INSTANCES(, float)
LAZYTENSOR_EIGEN_GEMM_ADD_NT_INSTANCES(, double)
LAZYTENSOR_EIGEN_GEMM_INSTANCES(, float)
LAZYTENSOR_EIGEN_GEMM_INSTANCES(, double)
LAZYTENSOR_EIGEN_GEMM_INSTANCES(, std::int32_t)
LAZYTENSOR_EIGEN_GEMM_INSTANCES(, std::int64_t)
LAZYTENSOR_MATMUL_INSTANCES(, float)
LAZYTENSOR_MATMUL_INSTANCES(, double)
LAZYTENSOR_MATMUL_INSTANCES(, std::int32_t)
LAZYTENSOR_MATMUL_INSTANCES(, std::int64_t)
LAZYTENSOR_CONV_INSTANCES(, float)
LAZYTENSOR_CONV_INSTANCES(, double)
LAZYTENSOR_POOL_INSTANCES(, float)
LAZYTENSOR_POOL_INSTANCES(, double)
LAZYTENSOR_SOFTMAX_INSTANCES(, float)
LAZYTENSOR_SOFTMAX_INSTANCES(, double)
// The train templates whose definitions sit in runtime blocks (the Trainer's constructor,
// the callbacks it can build, the precision factories): they are templates only so that
// header-only programs that never use them compile none of them.
LAZYTENSOR_TRAIN_EARLY_STOPPING_INSTANCES()
LAZYTENSOR_TRAIN_LR_MONITOR_INSTANCES()
LAZYTENSOR_TRAIN_PROGRESS_BAR_INSTANCES()
LAZYTENSOR_TRAIN_MODEL_CHECKPOINT_INSTANCES()
LAZYTENSOR_TRAIN_PRECISION_INSTANCES()
LAZYTENSOR_TRAIN_TRAINER_INSTANCES()
LAZYTENSOR_TRAIN_LOOPS_INSTANCES()

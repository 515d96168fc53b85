// lazytensor::compiled, second translation unit: the frontend's templates whose arguments the
// library fixes (nn layers, losses, initializers, Sequential::push_back, optimizers,
// gradient clipping, ReplicaStrategy, SpmdStrategy; their lists are in the nn/, optim/ and train/ headers,
// core/config.hpp explains them), instantiated once. The layers and losses in double and
// bfloat16 are in src/compiled_nn_wide.cpp, so that the three compile in parallel.
// Apart from src/compiled.cpp so that the two compile in parallel. It is built as a user's
// TU is (LAZYTENSOR_COMPILED): it sees the runtime as declarations, which src/compiled.cpp
// defines, and the `extern template` declarations its definitions follow.
#ifndef LAZYTENSOR_COMPILED
#define LAZYTENSOR_COMPILED 1
#endif
#include <lazytensor/lazytensor.hpp>

LAZYTENSOR_DIST_OPTIMIZER_STEP_INSTANCES()
LAZYTENSOR_NN_FUNCTIONAL_INSTANCES(, float)
LAZYTENSOR_NN_INIT_INSTANCES()
LAZYTENSOR_NN_ACTIVATION_INSTANCES(, float)
LAZYTENSOR_NN_LINEAR_INSTANCES()
LAZYTENSOR_NN_LINEAR_FORWARD_INSTANCES(, float)
LAZYTENSOR_NN_CONV_INSTANCES()
LAZYTENSOR_NN_CONV_FORWARD_INSTANCES(, float)
LAZYTENSOR_NN_POOLING_INSTANCES(, float)
LAZYTENSOR_NN_EMBEDDING_INSTANCES()
LAZYTENSOR_NN_EMBEDDING_FORWARD_INSTANCES(, float)
LAZYTENSOR_NN_NORMALIZATION_INSTANCES()
LAZYTENSOR_NN_NORMALIZATION_FORWARD_INSTANCES(, float)
LAZYTENSOR_NN_SEQUENTIAL_INSTANCES()
LAZYTENSOR_OPTIM_SGD_INSTANCES()
LAZYTENSOR_OPTIM_ADAM_INSTANCES()
LAZYTENSOR_NN_CLIP_GRAD_INSTANCES()
LAZYTENSOR_TRAIN_REPLICA_INSTANCES()
LAZYTENSOR_TRAIN_SPMD_INSTANCES()
LAZYTENSOR_TRAIN_ACCELERATOR_INSTANCES()

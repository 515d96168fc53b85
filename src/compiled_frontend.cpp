// lazytensor::compiled, second translation unit: the frontend's templates whose arguments the
// library fixes (nn layers, losses, initializers, Sequential::push_back, optimizers,
// gradient clipping, ReplicaStrategy; their lists are in the nn/, optim/ and train/ headers,
// core/config.hpp explains them), instantiated once.
// Apart from src/compiled.cpp so that the two compile in parallel. It is built as a user's
// TU is (LAZYTENSOR_COMPILED): it sees the runtime as declarations, which src/compiled.cpp
// defines, and the `extern template` declarations its definitions follow.
#ifndef LAZYTENSOR_COMPILED
#define LAZYTENSOR_COMPILED 1
#endif
#include <lazytensor/lazytensor.hpp>

LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_FUNCTIONAL_INSTANCES, )
LAZYTENSOR_NN_FUNCTIONAL_FLOAT_INSTANCES()
LAZYTENSOR_NN_INIT_INSTANCES()
LAZYTENSOR_NN_ACTIVATION_INSTANCES()
LAZYTENSOR_NN_LINEAR_INSTANCES()
LAZYTENSOR_NN_CONV_INSTANCES()
LAZYTENSOR_NN_POOLING_INSTANCES()
LAZYTENSOR_NN_EMBEDDING_INSTANCES()
LAZYTENSOR_NN_NORMALIZATION_INSTANCES()
LAZYTENSOR_NN_SEQUENTIAL_INSTANCES()
LAZYTENSOR_OPTIM_SGD_INSTANCES()
LAZYTENSOR_OPTIM_ADAM_INSTANCES()
LAZYTENSOR_NN_CLIP_GRAD_INSTANCES()
LAZYTENSOR_TRAIN_REPLICA_INSTANCES()

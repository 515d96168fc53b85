// lazytensor::compiled, third translation unit: nn's layers and losses in double and
// bfloat16 (src/compiled_frontend.cpp has them in float), instantiated once. Apart so that
// the library's translation units compile in parallel; built as a user's TU is (see
// src/compiled_frontend.cpp).
#ifndef LAZYTENSOR_COMPILED
#define LAZYTENSOR_COMPILED 1
#endif
#include <lazytensor/lazytensor.hpp>

LAZYTENSOR_NN_FUNCTIONAL_INSTANCES(, double)
LAZYTENSOR_NN_FUNCTIONAL_INSTANCES(, lazy::bfloat16)
LAZYTENSOR_NN_ACTIVATION_INSTANCES(, double)
LAZYTENSOR_NN_ACTIVATION_INSTANCES(, lazy::bfloat16)
LAZYTENSOR_NN_LINEAR_FORWARD_INSTANCES(, double)
LAZYTENSOR_NN_LINEAR_FORWARD_INSTANCES(, lazy::bfloat16)
LAZYTENSOR_NN_CONV_FORWARD_INSTANCES(, double)
LAZYTENSOR_NN_CONV_FORWARD_INSTANCES(, lazy::bfloat16)
LAZYTENSOR_NN_POOLING_INSTANCES(, double)
LAZYTENSOR_NN_POOLING_INSTANCES(, lazy::bfloat16)
LAZYTENSOR_NN_EMBEDDING_FORWARD_INSTANCES(, double)
LAZYTENSOR_NN_EMBEDDING_FORWARD_INSTANCES(, lazy::bfloat16)
LAZYTENSOR_NN_NORMALIZATION_FORWARD_INSTANCES(, double)
LAZYTENSOR_NN_NORMALIZATION_FORWARD_INSTANCES(, lazy::bfloat16)

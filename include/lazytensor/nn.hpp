#pragma once
// lazy::nn: modules, layers, initializers and losses (torch::nn).

#include <lazytensor/core/config.hpp>
#include <lazytensor/nn/activation.hpp>
#include <lazytensor/nn/conv.hpp>
#include <lazytensor/nn/embedding.hpp>
#include <lazytensor/nn/functional.hpp>
#include <lazytensor/nn/init.hpp>
#include <lazytensor/nn/linear.hpp>
#include <lazytensor/nn/module.hpp>
#include <lazytensor/nn/normalization.hpp>
#include <lazytensor/nn/pooling.hpp>
#include <lazytensor/nn/sequential.hpp>
#include <lazytensor/nn/utils/clip_grad.hpp>

// Sequential::push_back of the library's own float -> float layers, instantiated once in the
// compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_SEQUENTIAL_INSTANCES(P)                                  \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Linear);      \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Conv2d);      \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::MaxPool2d);   \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::AvgPool2d);   \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::ReLU);        \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::GELU);        \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Tanh);        \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Sigmoid);     \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::SiLU);        \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Flatten);     \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Dropout);     \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::LayerNorm);   \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::BatchNorm1d); \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::BatchNorm2d); \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Sequential);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_SEQUENTIAL_INSTANCES(extern)
#endif

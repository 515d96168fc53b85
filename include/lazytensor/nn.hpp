#pragma once
// lazy::nn: modules, layers, initializers and losses (torch::nn).

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

#pragma once
// lazy::optim: optimizers and learning-rate schedulers (torch::optim).

#include <lazytensor/optim/adam.hpp>
#include <lazytensor/optim/lr_scheduler.hpp>
#include <lazytensor/optim/optimizer.hpp>
#include <lazytensor/optim/sgd.hpp>

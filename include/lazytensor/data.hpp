#pragma once
// lazy::data: datasets, transforms, samplers and the DataLoader, with libtorch's names
// (torch::data). Reading gzip'd IDX files (MNIST) needs zlib: link ZLIB::ZLIB.

#include <lazytensor/data/data_loader.hpp>
#include <lazytensor/data/dataset.hpp>
#include <lazytensor/data/example.hpp>
#include <lazytensor/data/idx.hpp>
#include <lazytensor/data/mnist.hpp>
#include <lazytensor/data/sampler.hpp>
#include <lazytensor/data/shuffle.hpp>
#include <lazytensor/data/tensor_dataset.hpp>
#include <lazytensor/data/transforms.hpp>

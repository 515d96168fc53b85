#pragma once
// lazy::io: reading and writing tensors. safetensors files (readable by the Python
// `safetensors` package) through io::save_file and io::load, with atomic, streaming writes;
// io::save writes from replicas (only the master writes, as xm.save).

#include <lazytensor/io/safetensors.hpp>
#include <lazytensor/io/save.hpp>

#pragma once
// lazy::io: reading and writing tensors. safetensors files (readable by the Python
// `safetensors` package) through io::save_file and io::load, with atomic, streaming writes.

#include <lazytensor/io/safetensors.hpp>

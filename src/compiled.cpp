// lazytensor::compiled: the one translation unit that defines the non-template runtime
// (device, executor, planner, pools, thread pool, collectives' transport, file and format
// readers). Users linking the target compile with LAZYTENSOR_COMPILED, so their headers
// only declare these parts. See include/lazytensor/core/config.hpp.
#define LAZYTENSOR_BUILDING_RUNTIME
#include <lazytensor/lazytensor.hpp>

// Compiles the precompiled header shared by the test targets (see tests/CMakeLists.txt).

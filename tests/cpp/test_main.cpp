// main() of every GoogleTest binary. The core reads no environment variable (the Python layer
// passes VITRIFY_LIBCUDA_PATH down at import); for the C++ tests this file is the one place that
// does the same, so ctest can point a binary at a fake or missing driver (tests/cpp/CMakeLists.txt).
// A binary that needs one particular driver sets it itself, from a gtest Environment, which runs
// after this.
#include <gtest/gtest.h>

#include <cstdlib>

#include "vitrify/driver.hpp"

int main(int argc, char** argv) {
  if (const char* p = std::getenv("VITRIFY_LIBCUDA_PATH"); p != nullptr && *p != '\0')
    vitrify::driver::set_library_path(p);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

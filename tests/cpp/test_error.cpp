#include <gtest/gtest.h>

#include <unistd.h>

#include <string>

#include "vitrify/aligned.hpp"
#include "vitrify/error.hpp"



TEST(Errors, CudaErrorCarriesEverything) {
  vitrify::CudaError e(1, "CUDA_ERROR_INVALID_VALUE", "cuMemMap(p, n, 0, h, 0)", "csrc/x.cpp:10",
                    "invalid argument");
  const std::string msg = e.what();
  EXPECT_NE(msg.find("cuMemMap(p, n, 0, h, 0) failed"), std::string::npos) << msg;
  EXPECT_NE(msg.find("CUDA_ERROR_INVALID_VALUE (1)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("csrc/x.cpp:10"), std::string::npos) << msg;
  EXPECT_EQ(e.code(), 1);
  EXPECT_EQ(e.call(), "cuMemMap(p, n, 0, h, 0)");
}

TEST(Errors, MacroNamesCallAndPlace) {
  try {
    VITRIFY_CU(2);  // CUDA_ERROR_OUT_OF_MEMORY
    FAIL() << "no throw";
  } catch (const vitrify::CudaOutOfMemory& e) {
    EXPECT_EQ(e.code(), 2);
    EXPECT_NE(std::string(e.what()).find("test_error.cpp"), std::string::npos) << e.what();
  }
  try {
    VITRIFY_CU(1);
    FAIL() << "no throw";
  } catch (const vitrify::CudaOutOfMemory&) {
    FAIL() << "INVALID_VALUE must not be an OOM";
  } catch (const vitrify::CudaError& e) {
    EXPECT_EQ(e.code(), 1);
    EXPECT_EQ(e.call(), "1");
  }
}

TEST(Errors, SyscallCarriesErrno) {
  try {
    VITRIFY_SYSCALL(::close(-1));
    FAIL() << "no throw";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), EBADF);
    EXPECT_NE(std::string(e.what()).find("::close(-1)"), std::string::npos) << e.what();
  }
  try {
    VITRIFY_ERRNO_RESULT(ENOSPC);
    FAIL() << "no throw";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), ENOSPC);
  }
}

TEST(Errors, ExpectIsInvalidArgument) {
  EXPECT_THROW(VITRIFY_EXPECT(1 + 1 == 3, "arithmetic"), std::invalid_argument);
  EXPECT_NO_THROW(VITRIFY_EXPECT(true, "never"));
}

TEST(Aligned, BufferIsAlignedZeroedAndMovable) {
  vitrify::AlignedBuffer a(5000, 4096);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 4096, 0u);
  EXPECT_EQ(a.size(), 8192u);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a.data()[i], 0);
  vitrify::AlignedBuffer b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.size(), 8192u);
  EXPECT_THROW(vitrify::AlignedBuffer(10, 3000), std::invalid_argument);
  EXPECT_EQ(vitrify::round_up(0, 4096), 0u);
  EXPECT_EQ(vitrify::round_up(4097, 4096), 8192u);
}

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>

#include <string>

#include "vitrify/aligned.hpp"
#include "vitrify/error.hpp"



TEST(Errors, CudaErrorCarriesEverything) {
  vitrify::CudaError e(1, "CUDA_ERROR_INVALID_VALUE", "cuMemMap(p, n, 0, h, 0)", "csrc/x.cpp:10",
                    "invalid argument");
  const std::string msg = e.what();
  EXPECT_EQ(msg, "cuMemMap(p, n, 0, h, 0) failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument");
  EXPECT_EQ(e.where(), "csrc/x.cpp:10");  // the place is an attribute, not part of the message
  EXPECT_EQ(e.code(), 1);
  EXPECT_EQ(e.call(), "cuMemMap(p, n, 0, h, 0)");
}

TEST(Errors, CallNameIsTheCalledFunctionNotTheSourceText) {
  using vitrify::detail::call_name;
  EXPECT_EQ(call_name("d.cuMemCreate(&handle_, size_, &prop, 0)"), "cuMemCreate");
  EXPECT_EQ(call_name("driver::cu().cuMemcpyDtoH(dst, base_ + offset, n)"), "cuMemcpyDtoH");
  EXPECT_EQ(call_name("CU_NEED(cuGraphLaunch)(T.exec, stream)"), "cuGraphLaunch");
  EXPECT_EQ(call_name("::statfs(path.c_str(), &st)"), "statfs");
  EXPECT_EQ(call_name("::fdatasync(fd.get())"), "fdatasync");
  EXPECT_EQ(call_name("2"), "2");
}

TEST(Errors, MacroNamesTheCallAndKeepsThePlaceAsAnAttribute) {
  struct Fake {
    static int cuMemMap(int a, int b) { return a + b; }
  } d;
  try {
    VITRIFY_CU(d.cuMemMap(1, 1));  // CUDA_ERROR_OUT_OF_MEMORY
    FAIL() << "no throw";
  } catch (const vitrify::CudaOutOfMemory& e) {
    EXPECT_EQ(e.code(), 2);
    EXPECT_EQ(e.call(), "cuMemMap");
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("cuMemMap failed: ", 0), 0u) << msg;  // the result name needs a driver
    EXPECT_NE(msg.find(" (2)"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("d.cuMemMap"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("test_error.cpp"), std::string::npos) << msg;
    EXPECT_NE(e.where().find("test_error.cpp"), std::string::npos) << e.where();
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

TEST(Errors, SyscallNamesTheCallErrnoAndPath) {
  const std::string path = "/some/file.slab";
  try {
    VITRIFY_SYSCALL(::close(-1), path);
    FAIL() << "no throw";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), EBADF);
    EXPECT_EQ(std::string(e.what()), std::string("close(\"/some/file.slab\"): ") + std::strerror(EBADF));
  }
  try {
    VITRIFY_ERRNO_RESULT(ENOSPC, "");
    FAIL() << "no throw";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), ENOSPC);
    EXPECT_EQ(std::string(e.what()).find("at "), std::string::npos) << e.what();
  }
}

TEST(Errors, ExpectIsInvalidArgumentWithTheMessageOnly) {
  try {
    VITRIFY_EXPECT(1 + 1 == 3, "arithmetic must hold, got 3");
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "arithmetic must hold, got 3");
  }
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

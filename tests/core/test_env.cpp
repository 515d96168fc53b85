// core/env.hpp: strict readers of LAZYTENSOR_* settings. A value that is not what the
// setting takes is an error naming the variable, never silently a default.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include <lazytensor/core/env.hpp>

namespace {

constexpr const char* kVar = "LAZYTENSOR_TEST_ENV_SETTING";  // no real setting of this name

/// Sets kVar for the scope of a test and unsets it afterwards.
struct ScopedVar {
  explicit ScopedVar(const char* value) { ::setenv(kVar, value, 1); }
  ~ScopedVar() { ::unsetenv(kVar); }
};

TEST(EnvSwitch, UnsetOrEmptyMeansNoChoice) {
  ::unsetenv(kVar);
  EXPECT_FALSE(lazy::core::env_switch(kVar).has_value());
  ScopedVar empty("");
  EXPECT_FALSE(lazy::core::env_switch(kVar).has_value());
}

TEST(EnvSwitch, ReadsEveryOnAndOffSpelling) {
  for (const char* on : {"1", "on", "true"}) {
    ScopedVar v(on);
    EXPECT_EQ(lazy::core::env_switch(kVar), true) << on;
  }
  for (const char* off : {"0", "off", "false"}) {
    ScopedVar v(off);
    EXPECT_EQ(lazy::core::env_switch(kVar), false) << off;
  }
}

TEST(EnvSwitch, AnythingElseIsAnErrorNamingTheVariableAndTheValue) {
  for (const char* bad : {"yes", "2", "00", "ON ", "maybe"}) {
    ScopedVar v(bad);
    try {
      (void)lazy::core::env_switch(kVar);
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const lazy::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(kVar), std::string::npos) << what;
      EXPECT_NE(what.find(std::string("'") + bad + "'"), std::string::npos) << what;
      EXPECT_NE(what.find("on/off"), std::string::npos) << what;
    }
  }
}

TEST(EnvInteger, ReadsWholeNumbersAtOrAboveTheMinimum) {
  ::unsetenv(kVar);
  EXPECT_FALSE(lazy::core::env_integer(kVar, 1, "things", "8").has_value());
  {
    ScopedVar v("42");
    EXPECT_EQ(lazy::core::env_integer(kVar, 1, "things", "8"), 42);
  }
  {
    ScopedVar v("0");
    EXPECT_EQ(lazy::core::env_integer(kVar, 0, "things", "8"), 0);
  }
  for (const char* bad : {"0", "-3", "4x", "x", "1.5"}) {
    ScopedVar v(bad);
    try {
      (void)lazy::core::env_integer(kVar, 1, "things", "8");
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const lazy::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(kVar), std::string::npos) << what;
      EXPECT_NE(what.find("things >= 1"), std::string::npos) << what;
    }
  }
}

}  // namespace

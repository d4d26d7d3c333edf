// Runs a body with stderr sent to a temporary file and returns what was written there: for tests
// of log lines (Catch2 reports on stdout, so its output stays out of it).
#pragma once

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <string>

template <typename Body>
std::string capture_stderr(Body body) {
  std::FILE* file = std::tmpfile();
  REQUIRE(file != nullptr);
  int saved = dup(STDERR_FILENO);
  REQUIRE(dup2(fileno(file), STDERR_FILENO) >= 0);
  body();
  dup2(saved, STDERR_FILENO);
  close(saved);
  std::string text;
  std::rewind(file);
  char buffer[4096];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof(buffer), file)) > 0) text.append(buffer, got);
  std::fclose(file);
  return text;
}

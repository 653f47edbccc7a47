#pragma once
// Library version; CMake's project() version is the source of truth and
// tests check that the two agree.
#define KVEVICT_VERSION_MAJOR 0
#define KVEVICT_VERSION_MINOR 1
#define KVEVICT_VERSION_PATCH 0
#define KVEVICT_VERSION (KVEVICT_VERSION_MAJOR * 10000 + KVEVICT_VERSION_MINOR * 100 + KVEVICT_VERSION_PATCH)

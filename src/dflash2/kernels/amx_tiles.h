// What every kernel on AMX tiles needs (gemm_amx.cpp, gemm_gguf_amx.h): the tile configuration's layout and the
// request for the tile state.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

// The 64-byte operand of LDTILECFG (palette 1: 8 tiles of up to 16 rows x 64 bytes).
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux keeps a process's AMX tile data state off until the process asks for it (arch_prctl with
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); once granted, every thread of the process may use the tiles.
// True when the tiles may be used.
inline bool request_amx_tiles() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

/* What the AMX kernels share: whether the build knows the tile instructions, the process's permission to
 * use the tile registers, and the tile configuration record. Tile state is per thread: each kernel loads
 * its configuration inside its parallel region and releases the tiles before leaving it. */
#pragma once

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX_BF16 1
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether this process may use the tile registers: Linux grants them on request, once per process. */
static inline int amx_permitted(void) {
    static int permitted = -1; /* racing threads ask twice: harmless */
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* Palette 1: per tile register, its bytes per row and its rows (0 and 0 for a register left unused). */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Load a configuration. GCC's ldtilecfg declares no memory read, so without the barrier it may drop the
 * stores that fill the record (it did, inlined into a parallel region: the tile instructions then fault). */
static inline void load_tile_config(const struct tile_config *c) {
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(c);
}
#endif

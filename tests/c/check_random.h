/*
 * check_random.h -- the random bits of the single-file checks in tests/c: xorshift64, fixed
 * seed, so that a check sees the same values on every run and machine.
 */
#ifndef CHECK_RANDOM_H
#define CHECK_RANDOM_H

#include <stdint.h>

static uint64_t random_state = 0x9e3779b97f4a7c15u;

static uint64_t random_bits(void)
{
    random_state ^= random_state << 13;
    random_state ^= random_state >> 7;
    random_state ^= random_state << 17;
    return random_state;
}

#endif

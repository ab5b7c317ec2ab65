/*
 * fuzz-index.c — libFuzzer target: the pack index a compute-side mount reads
 * from a storage node (DIR/.hapifs-pack.json, through any network
 * filesystem: torn, foreign or hostile). It must be refused with a reason,
 * never crash or let a name leave its directory.
 *
 * Input: the index text; the first byte picks the directory it is read for.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "hapi.h"
#include "remote.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char *const dirs[] = { "", "class0", "a/b/c", "train/n01440764" };
    if (size < 1)
        return 0;
    hapi_error err = { 0 };
    int rc = hapi_remote_index_check((const char *)data + 1, size - 1, dirs[data[0] & 3], &err);
    if (rc < 0 && !err.message[0])
        abort(); /* every refusal says why */
    if (getenv("HAPI_FUZZ_VERBOSE")) /* to see what a seed reaches */
        fprintf(stderr, "index for '%s': %s\n", dirs[data[0] & 3], rc == 0 ? "accepted" : err.message);
    return 0;
}

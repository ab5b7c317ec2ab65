/*
 * fuzz-ctl.c — libFuzzer target: the parser of commands written to
 * .hapifs/ctl (any user's bytes on a mount with ctl_group=): lines, words,
 * command names, numbers, rates, times, paths that must stay beneath the
 * mount. hapi_ctl_command() runs exactly this check before it changes
 * anything.
 *
 * Input: the bytes of one write(2); the first byte's low bit selects a
 * remote mount's command set.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

#include "ctl.h"
#include "hapi.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    hapi_error err = { 0 };
    int rc = hapi_ctl_check((const char *)data + 1, size - 1, data[0] & 1, &err);
    if (rc < 0 && !err.message[0])
        abort(); /* every refusal says why */
    if (rc != 0 && rc != -EINVAL)
        abort(); /* a check is a syntax verdict */
    return 0;
}

/* main.c — the hapifs executable; called as mount.hapifs it speaks mount(8)'s helper protocol. */
#include <string.h>

#include "fusefs.h"

int main(int argc, char *argv[])
{
    const char *base = strrchr(argv[0], '/');
    base = base ? base + 1 : argv[0];
    return hapi_fs_main(argc, argv, strncmp(base, "mount.", 6) == 0);
}

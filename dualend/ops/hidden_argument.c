/* Preloaded into tritonserver by dualend.ops.launch (LD_PRELOAD). tritonserver 2.51 takes the admin key
 * only as an argument, and a process's arguments are world-readable (/proc/PID/cmdline, ps). So the
 * launcher passes a marker in the argument and the key in DUALEND_HIDDEN_ARGUMENT; before main() runs,
 * this points each argument holding the marker at a copy with the key put in, leaving the memory that
 * /proc/PID/cmdline reads as it was (marker only). It then blanks the variable's value in the
 * environment block and removes it from the environment children inherit. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#define MARKER "@dualend-hidden-argument@"
#define VARIABLE "DUALEND_HIDDEN_ARGUMENT"

__attribute__((constructor)) static void put_in_hidden_argument(int argc, char **argv, char **envp) {
    const char *value = getenv(VARIABLE);
    if (value == NULL)
        return;
    char *secret = strdup(value);
    size_t marker_length = strlen(MARKER), secret_length = strlen(secret);
    for (int i = 1; i < argc && secret != NULL; i++) {
        char *at = strstr(argv[i], MARKER);
        if (at == NULL)
            continue;
        size_t before = (size_t)(at - argv[i]), after = strlen(at + marker_length);
        char *argument = malloc(before + secret_length + after + 1);
        if (argument == NULL)
            continue;
        memcpy(argument, argv[i], before);
        memcpy(argument + before, secret, secret_length);
        memcpy(argument + before + secret_length, at + marker_length, after + 1);
        argv[i] = argument;
    }
    size_t prefix = strlen(VARIABLE "=");
    for (char **entry = envp; *entry != NULL; entry++)
        if (strncmp(*entry, VARIABLE "=", prefix) == 0)
            memset(*entry + prefix, 'x', strlen(*entry + prefix));
    if (secret != NULL) {
        memset(secret, 0, secret_length);
        free(secret);
    }
    unsetenv(VARIABLE);
}

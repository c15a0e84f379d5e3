/* A C consumer of tensors a tensorwire receiver shares.
 *
 *   consumer SOCKET NAME [--increment]
 *
 * Waits up to 10 s (or $TW_WAIT_MS milliseconds) for NAME, prints its dtype, shape, generation and where it lives, and a
 * checksum of its bytes; with --increment adds 1 to every byte in place (the producer and
 * other consumers see it). Build (from the repository root, after `cargo build -p
 * tensorwire-c`):
 *
 *   cc crates/tensorwire-c/examples/consumer.c -I crates/tensorwire-c/include \
 *      -L target/debug -ltensorwire_c -Wl,-rpath,$PWD/target/debug -o consumer
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensorwire.h"

static int fail(const char *what) {
    fprintf(stderr, "%s: %s\n", what, tw_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s SOCKET NAME [--increment]\n", argv[0]);
        return 2;
    }
    int increment = argc > 3 && strcmp(argv[3], "--increment") == 0;
    tw_client *client = NULL;
    if (tw_connect(argv[1], &client) != TW_OK) return fail("connect");
    tw_tensor *tensor = NULL;
    const char *wait = getenv("TW_WAIT_MS");
    if (tw_open(client, argv[2], wait ? strtoull(wait, NULL, 10) : 10000, &tensor) != TW_OK) {
        tw_client_close(client);
        return fail("open");
    }
    size_t len = (size_t)tw_tensor_byte_len(tensor);
    printf("%s %s [", tw_tensor_name(tensor), tw_tensor_dtype(tensor));
    const uint64_t *shape = tw_tensor_shape(tensor);
    for (size_t i = 0; i < tw_tensor_ndim(tensor); i++)
        printf("%s%" PRIu64, i ? ", " : "", shape[i]);
    printf("] generation %" PRIu64 " %s\n", tw_tensor_generation(tensor),
           tw_tensor_device_ordinal(tensor) < 0 ? "host" : "gpu");

    unsigned char *bytes = malloc(len ? len : 1);
    if (!bytes || tw_tensor_read(tensor, 0, bytes, len) != TW_OK) return fail("read");
    uint64_t sum = 0;
    for (size_t i = 0; i < len; i++) sum += bytes[i];
    printf("sum %" PRIu64 "\n", sum);
    if (increment) {
        for (size_t i = 0; i < len; i++) bytes[i] += 1;
        if (tw_tensor_write(tensor, bytes, len) != TW_OK) return fail("write");
        printf("incremented\n");
    }
    free(bytes);
    tw_tensor_release(tensor);
    tw_client_close(client);
    return 0;
}

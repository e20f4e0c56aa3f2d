/* The floor under a small collective here: two processes bounce one small UDP datagram
 * over loopback with blocking recv, as plain as a round trip gets. Prints the median and
 * the mean round trip in microseconds. Built and run by bench/latency_breakdown.py.
 *
 *   udp_floor [iterations] [payload bytes]
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int bound(struct sockaddr_in *addr) {
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    memset(addr, 0, sizeof *addr);
    addr->sin_family = AF_INET;
    addr->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof *addr;
    if (fd < 0 || bind(fd, (struct sockaddr *)addr, len) < 0 ||
        getsockname(fd, (struct sockaddr *)addr, &len) < 0) {
        perror("udp_floor: socket");
        exit(1);
    }
    return fd;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int iters = argc > 1 ? atoi(argv[1]) : 2000;
    int size = argc > 2 ? atoi(argv[2]) : 8;
    if (iters < 1 || size < 1 || size > 1400) {
        fprintf(stderr, "udp_floor: iterations >= 1, payload 1..1400 bytes\n");
        return 2;
    }
    struct sockaddr_in a, b;
    int fa = bound(&a), fb = bound(&b);
    char buf[1500] = {0};
    pid_t child = fork();
    if (child == 0) { /* the echo side */
        close(fa);
        connect(fb, (struct sockaddr *)&a, sizeof a);
        for (int i = 0; i < iters + 100; i++) {
            ssize_t n = recv(fb, buf, sizeof buf, 0);
            if (n <= 0 || send(fb, buf, (size_t)n, 0) != n) _exit(1);
        }
        _exit(0);
    }
    close(fb);
    connect(fa, (struct sockaddr *)&b, sizeof b);
    double *rtt = malloc(sizeof(double) * (size_t)iters), sum = 0;
    for (int i = 0; i < iters + 100; i++) { /* 100 warm-up round trips first */
        double t = now_us();
        if (send(fa, buf, (size_t)size, 0) != size || recv(fa, buf, sizeof buf, 0) != size) {
            perror("udp_floor: round trip");
            return 1;
        }
        if (i >= 100) {
            rtt[i - 100] = now_us() - t;
            sum += rtt[i - 100];
        }
    }
    waitpid(child, NULL, 0);
    qsort(rtt, (size_t)iters, sizeof(double), cmp);
    printf("{\"iterations\": %d, \"payload\": %d, \"median_rtt_us\": %.2f, \"mean_rtt_us\": %.2f}\n",
           iters, size, rtt[iters / 2], sum / iters);
    return 0;
}

/*
 * tcp_loopback: what TCP over this host's loopback can carry in the pattern of a ring collective,
 * with nothing else to do: N processes in a ring, each sending BYTES to the next and receiving
 * BYTES from the previous at the same time, through non-blocking sockets and poll(), with the
 * socket options kolo's TCP transport sets (TCP_NODELAY, 4 MiB buffers, at most 128 KiB unsent
 * (TCP_NOTSENT_LOWAT), and within one host the congestion control reno). At N = 2 the two share one
 * connection, both directions at once, as two ranks of kolo do.
 *
 *   tcp_loopback N BYTES ITERATIONS [PIECE [CONGESTION]]
 *
 * PIECE (default 1 MiB) is the most one send() or recv() is asked to move. CONGESTION (default
 * reno, as kolo's KOLO_TCP_CONGESTION=auto on one host) is set on every socket; "system" keeps
 * the kernel's default. Each iteration starts
 * at a barrier (a byte around the ring's own sockets is not used: a pipe from every process to the
 * parent and back). Prints the median and best per-process rate in GB/s (10^9 bytes sent per
 * second by one process), which is an upper bound of an allreduce's busbw over the same sockets:
 * a ring allreduce sends 2(N-1)/N of the buffer per rank, and busbw is exactly that divided by
 * the time, so busbw cannot exceed the rate at which a process can send while it also receives.
 * A second line per rank gives the CPU time the process spent in the timed iterations (user and
 * system seconds, getrusage) and the bytes it sent in them, so that the CPU cost of a byte can be
 * set beside kolo's (bench/tcp_ceiling.sh).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { kMaxRanks = 64, kMaxIterations = 10000, kSocketBuffer = 4 << 20 };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void die(const char* what) {
  perror(what);
  exit(1);
}

static const char* congestion = "reno";

static void tune(int fd) {
  int one = 1, bytes = kSocketBuffer;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
  int unsent = 128 << 10;
  setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &unsent, sizeof unsent);
  if (strcmp(congestion, "system") != 0 &&
      setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, congestion, strlen(congestion)) != 0) {
    die("setsockopt(TCP_CONGESTION)");
  }
}

static void read_exactly(int fd, void* buffer, size_t size) {
  for (size_t done = 0; done < size;) {
    ssize_t n = read(fd, (char*)buffer + done, size - done);
    if (n <= 0) die("read");
    done += (size_t)n;
  }
}

/* Moves BYTES out on `out` and BYTES in on `in` (the same descriptor at N = 2), both at once. */
static void exchange(int out, int in, const char* send_buffer, char* recv_buffer, size_t bytes,
                     size_t piece) {
  size_t sent = 0, received = 0;
  while (sent < bytes || received < bytes) {
    struct pollfd fds[2];
    int count = 0;
    if (out == in) {
      fds[count++] = (struct pollfd){
          out, (short)((sent < bytes ? POLLOUT : 0) | (received < bytes ? POLLIN : 0)), 0};
    } else {
      if (sent < bytes) fds[count++] = (struct pollfd){out, POLLOUT, 0};
      if (received < bytes) fds[count++] = (struct pollfd){in, POLLIN, 0};
    }
    if (poll(fds, (nfds_t)count, 10000) <= 0) die("poll (nothing moved for 10 s)");
    /* Then each way until the kernel has no more room or data, as kolo's transport does. */
    for (int moved = 1; moved;) {
      moved = 0;
      if (sent < bytes) {
        size_t want = bytes - sent < piece ? bytes - sent : piece;
        ssize_t n = send(out, send_buffer + sent, want, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0)
          sent += (size_t)n, moved = 1;
        else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
          die("send");
      }
      if (received < bytes) {
        size_t want = bytes - received < piece ? bytes - received : piece;
        ssize_t n = recv(in, recv_buffer + received, want, MSG_DONTWAIT);
        if (n > 0)
          received += (size_t)n, moved = 1;
        else if (n == 0)
          die("recv (peer closed)");
        else if (errno != EAGAIN && errno != EWOULDBLOCK)
          die("recv");
      }
    }
  }
}

static double cpu_seconds(const struct timeval* t) {
  return (double)t->tv_sec + (double)t->tv_usec * 1e-6;
}

static int compare_doubles(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  if (argc < 4 || argc > 6) {
    fprintf(stderr, "usage: %s N BYTES ITERATIONS [PIECE [CONGESTION]]\n", argv[0]);
    return 2;
  }
  const int ranks = atoi(argv[1]);
  const size_t bytes = strtoull(argv[2], NULL, 0);
  const int iterations = atoi(argv[3]);
  const size_t piece = argc >= 5 ? strtoull(argv[4], NULL, 0) : (size_t)1 << 20;
  if (argc == 6) congestion = argv[5];
  if (ranks < 2 || ranks > kMaxRanks || bytes == 0 || iterations < 1 ||
      iterations > kMaxIterations || piece == 0) {
    fprintf(stderr, "need 2 <= N <= %d, BYTES > 0, 1 <= ITERATIONS <= %d, PIECE > 0\n", kMaxRanks,
            kMaxIterations);
    return 2;
  }
  alarm(600); /* a benchmark that cannot finish is killed, not left behind */

  /* Every rank's listener, bound before the fork so that the ports are known to all. */
  int listeners[kMaxRanks];
  uint16_t ports[kMaxRanks];
  for (int r = 0; r < ranks; ++r) {
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t length = sizeof address;
    listeners[r] = socket(AF_INET, SOCK_STREAM, 0);
    if (listeners[r] < 0 || bind(listeners[r], (struct sockaddr*)&address, sizeof address) != 0 ||
        listen(listeners[r], 4) != 0 ||
        getsockname(listeners[r], (struct sockaddr*)&address, &length) != 0) {
      die("listen on 127.0.0.1");
    }
    ports[r] = ntohs(address.sin_port);
  }
  /* The barrier: each rank writes a byte to the parent, which answers all once all have. */
  int up[kMaxRanks][2], down[kMaxRanks][2];
  pid_t children[kMaxRanks];
  for (int r = 0; r < ranks; ++r) {
    if (pipe(up[r]) != 0 || pipe(down[r]) != 0) die("pipe");
  }
  for (int me = 0; me < ranks; ++me) {
    children[me] = fork();
    if (children[me] < 0) die("fork");
    if (children[me] > 0) continue;
    alarm(600);

    /* A rank: connect to the next, accept the previous (at N = 2 rank 0 connects, 1 accepts). */
    const int next = (me + 1) % ranks;
    int out = -1, in = -1;
    if (ranks > 2 || me == 0) {
      struct sockaddr_in address = {.sin_family = AF_INET,
                                    .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                                    .sin_port = htons(ports[next])};
      out = socket(AF_INET, SOCK_STREAM, 0);
      if (out < 0 || connect(out, (struct sockaddr*)&address, sizeof address) != 0) die("connect");
    }
    if (ranks > 2 || me == 1) {
      in = accept(listeners[me], NULL, NULL);
      if (in < 0) die("accept");
    }
    if (ranks == 2) {
      if (me == 0)
        in = out;
      else
        out = in;
    }
    tune(out);
    if (in != out) tune(in);
    char* send_buffer = malloc(bytes);
    char* recv_buffer = malloc(bytes);
    if (!send_buffer || !recv_buffer) die("malloc");
    memset(send_buffer, me + 1, bytes);
    memset(recv_buffer, 0, bytes);

    double* seconds = malloc(sizeof(double) * (size_t)iterations);
    if (!seconds) die("malloc");
    struct rusage before, after;
    for (int i = -1; i < iterations; ++i) { /* i = -1: one untimed warm-up */
      char token = 0;
      if (write(up[me][1], &token, 1) != 1) die("write");
      read_exactly(down[me][0], &token, 1);
      if (i == 0 && getrusage(RUSAGE_SELF, &before) != 0) die("getrusage");
      double start = now();
      exchange(out, in, send_buffer, recv_buffer, bytes, piece);
      if (i >= 0) seconds[i] = now() - start;
    }
    if (getrusage(RUSAGE_SELF, &after) != 0) die("getrusage");
    const char expected = (char)((me + ranks - 1) % ranks + 1);
    for (size_t k = 0; k < bytes; k += 4096) {
      if (recv_buffer[k] != expected) {
        fprintf(stderr, "rank %d: byte %zu is %d, expected %d\n", me, k, recv_buffer[k], expected);
        exit(1);
      }
    }
    qsort(seconds, (size_t)iterations, sizeof *seconds, compare_doubles);
    printf("rank %d: %zu bytes each way, %d iterations: median %.3f GB/s, best %.3f GB/s\n", me,
           bytes, iterations, (double)bytes / seconds[iterations / 2] * 1e-9,
           (double)bytes / seconds[0] * 1e-9);
    printf("rank %d: cpu %.3f %.3f s sent %.4f GB\n", me,
           cpu_seconds(&after.ru_utime) - cpu_seconds(&before.ru_utime),
           cpu_seconds(&after.ru_stime) - cpu_seconds(&before.ru_stime),
           (double)bytes * iterations * 1e-9);
    fflush(stdout);
    exit(0);
  }

  for (int i = -1; i < iterations; ++i) {
    char token;
    for (int r = 0; r < ranks; ++r) read_exactly(up[r][0], &token, 1);
    for (int r = 0; r < ranks; ++r) {
      if (write(down[r][1], &token, 1) != 1) die("write");
    }
  }
  int failed = 0;
  for (int r = 0; r < ranks; ++r) {
    int status = 0;
    if (waitpid(children[r], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed = 1;
    }
  }
  return failed;
}

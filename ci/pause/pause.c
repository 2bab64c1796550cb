/* The pod sandbox's pause process: sleeps until told to stop, and reaps orphans as PID 1.
 * Built statically by ci/scripts/build-images.sh because no registry can serve one here. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) { (void)sig; _exit(0); }
static void on_child(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }

int main(void) {
    struct sigaction stop = {.sa_handler = on_stop}, child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
    sigaction(SIGINT, &stop, NULL);
    sigaction(SIGTERM, &stop, NULL);
    sigaction(SIGCHLD, &child, NULL);
    for (;;) pause();
}

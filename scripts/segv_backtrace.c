/* A native backtrace on SIGSEGV/SIGBUS/SIGABRT (a C++ terminate included), for crashes inside libraries that Python's
 * faulthandler shows only as a Python frame (issue 36: SIGSEGV inside torch.cuda.empty_cache()
 * under expandable segments). Built and preloaded on the GPU machine:
 *   gcc -shared -fPIC -O1 -o /tmp/segv_backtrace.so scripts/segv_backtrace.c
 *   LD_PRELOAD=/tmp/segv_backtrace.so python -m pytest -p no:faulthandler ...
 * Prints the faulting address and the frames (with exported symbol names) to stderr, then dies
 * of the same signal (backtrace() is not async-signal-safe: good enough for a process that is
 * dying anyway). Not part of the library. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_fatal(int sig, siginfo_t* info, void* context) {
  (void)context;
  char line[128];
  int n = snprintf(line, sizeof(line), "\n=== segv_backtrace: pid %d signal %d at address %p\n", (int)getpid(), sig,
                   info != NULL ? info->si_addr : NULL);
  if (n > 0) (void)!write(2, line, (size_t)n);
  void* frames[64];
  const int count = backtrace(frames, 64);
  backtrace_symbols_fd(frames, count, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction action;
  memset(&action, 0, sizeof(action));
  action.sa_sigaction = on_fatal;
  action.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, NULL);
  sigaction(SIGBUS, &action, NULL);
  sigaction(SIGABRT, &action, NULL);
}

// The daemons' signal setup: SIGINT and SIGTERM are taken by one thread
// that sigwait()s and asks the daemon to stop, so every other thread
// (gRPC's included) must have them blocked; and SIGPIPE is ignored, since a
// peer that resets a TLS link (through a relay, say) must fail the write,
// not kill the process (OpenSSL writes to its socket with plain write()).
#ifndef GEOTRAIN_COMMON_STOP_SIGNALS_H_
#define GEOTRAIN_COMMON_STOP_SIGNALS_H_

#include <signal.h>

namespace geotrain {

// Ignores SIGPIPE and blocks SIGINT and SIGTERM in the calling thread, and
// so in every thread it starts after; returns the blocked set for sigwait().
// Call first in main(), before any thread starts.
sigset_t BlockStopSignals();

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_STOP_SIGNALS_H_

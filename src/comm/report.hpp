// Who is stuck: on SIGUSR1 (kolorun passes it to every rank) every live communicator of the
// process logs, at WARN, what it is doing: the collective it is in, for how long and which peer it
// waits for, or the last one it finished; and its fusion engine's names in flight, what the
// engine's thread waits for, and on rank 0 the names that some ranks have not submitted. A job
// that hangs can so be asked, rank by rank, where it stands, without a debugger.
//
// The handler only writes a byte into a pipe; a thread of its own reads it and writes the
// reports, so nothing unsafe runs inside the signal handler. kolo installs the handler only where
// SIGUSR1 still has its default action (which ends the process); an application that handles
// SIGUSR1 itself keeps its handler, and that is logged at INFO.
#pragma once

namespace kolo {

class Communicator;

// Adds a communicator to those reported on, or takes it out (before it is destroyed: a report
// never reads a communicator that is going away). The first add installs the handler.
void report_on(Communicator* communicator);
void stop_reporting_on(Communicator* communicator);

}  // namespace kolo

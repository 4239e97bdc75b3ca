/*
 * Mutant: a lease adopted at a failover is taken to have no writer
 * Guard removed: the new leader does not know who writes an adopted lease's pages, so an adopted page keeps an
 *   unknown old-term writer (it leaves quarantine only after the old term's writes drained).
 * Counter-example: decode hands over a request whose prefill still writes under the old leader; the request
 *   ends and its Release reaches the new leader, which frees the page at once and grants it again while the
 *   old write still lands there (P4).
 */
#define FAILOVER
#define MUT_FO_ADOPT_NO_WRITER
#include "../pdserve.pml"

/*
 * Mutant: a request left out of decode's claim at a hand-over reads anyway
 * Guard removed: decode claims only the requests decoding; every other request it holds ends before it reads
 *   (UNAVAILABLE BROKER_FAILOVER), its pages nobody's at the new leader, quarantined for the old term's writes.
 * Counter-example: r0 is granted and written, decode leaves it out of the claim and still verifies and reads
 *   it; its page leaves quarantine once the old term drained and is granted to r1, whose write lands in the
 *   page r0 reads (P2 or P1).
 */
#define FAILOVER
#define CLAIM_SUBSET
#define MUT_FO_UNCLAIMED_READS
#define FAULTS 0          /* the failover alone */
#include "../pdserve.pml"

/*
 * pdserve: the KV-page lease and transfer protocol (DESIGN.md §3) as a SPIN model.
 * formal/README.md says what is modelled, what is abstracted and why that is sound, and maps
 * every element to services/. formal/check.sh runs it; mutants/*.pml each #define one MUT_*
 * flag (one guard removed) and #include this file; redundant/*.pml remove a guard that the
 * others cover.
 *
 *   Broker   LeaseTable: epoch, per-pool generation counter, page states FREE / LEASED /
 *            QUARANTINED, active writer (writer id, generation), one write per generation,
 *            a failed write's hold until the bound, writer liveness and lock_delay, sweep,
 *            revoke, lease expiry (-DLEASE_FAULTS), restart (new epoch, decode re-registers).
 *   Writer   prefill, one per request: BeginWrite, liveness check, forward pass into a
 *            source page, one-sided writes of the data and of the tag to the pool's
 *            registered addresses, wait for completion or a reported failure, EndWrite
 *            always (success, nothing_posted), re-sent until answered.
 *   Reader   decode, one per request, on one of two paths chosen at the grant: the old one
 *            (Allocate; wait for prefill's answer, verify_prompt_pages, Validate) or Run (one
 *            stream: wait for the broker's write-done notice, verify_prompt_pages against it,
 *            no Validate); then the check before every step (and the blind stop), Release;
 *            cancellable at every stage. With -DSTEP_WRITES a step is a check, then a later
 *            write of its own KV into its page (a stalled step thread), and the reader's
 *            KeepAlive acknowledges a revoked owner once no step of it can still write.
 *   Growth   (-DGROWTH, issue 19: pages on demand) a growing request's tokens go into a growth page that
 *            decode leases by Extend (refused unless the owner holds leases now; a fresh generation,
 *            sealed) and writes itself, stamping its tag; Release and Revoke are by owner, growth
 *            pages included; the broker takes the Extend at any time after decode sent it (after a
 *            Revoke, a Release, a move), its reply may be lost; -DHEADROOM: the Grant's headroom page.
 *   Prefix   (-DPREFIX, issue 20: prefix reuse) a request's page has a content identity (scope, position, tokens);
 *            decode publishes a page it verified: the broker makes it CACHED (read-only, readers, a chain index
 *            with the scope tag and the published checksum); a Grant whose chain key and scope tag match shares
 *            it, and decode checks it (tag, chain words, checksum) before reading: a bad one is unpublished and
 *            the Grant redone as a miss; Release / Revoke of one reader end only its share (a revoked share
 *            keeps the page until swept, as quarantine); unread cached pages are evicted; a cached page may
 *            change in place while unread (fault); a BeginWrite naming a cached page is refused. Decode's
 *            revocation stream may reconnect, or report a gap (a revocation notice it will never get): decode
 *            then re-checks every running request's leases with the broker (Validate with recheck: its own
 *            page LEASED to it, a shared or published one CACHED at its generation with it among the readers).
 *   Failover (-DFAILOVER, issue 29) the leading broker loses its etcd election (killed, partitioned, paused)
 *            and a standby takes over at a newer term, with the same lease identities (epoch,
 *            generations). The old leader's authority ended first (A8); what it authorised lands
 *            within its writers' liveness. Decode hands over the leases it holds (claims): they are
 *            adopted, sealed, their old-term writer unknown; a page the old leader had free may be
 *            free at once (the durable free set) or not; every other page waits for the old
 *            term's writes to drain. Running requests read on; a Grant reply of the old term that
 *            reaches decode after it handed over is refused; a write's liveness is extended only
 *            by answers of the term that began it.
 *   Expiry   (-DEXPIRY) decode's allocation expiry (and drain), racing the reader's take:
 *            each allocation is handed out once, to the reader or to expiry, which releases it.
 *   Net      delivers one-sided writes late and in any order (data and tag of one write too);
 *            reports a transfer failed or timed out while its posted writes may still land
 *            (until the enforced bound), or, as a fault, loses one silently; loses, duplicates
 *            and delays EndWrite; delays revocation and write-done notices, in order on one
 *            stream (it may drop, delay and disconnect: with the cursor a dropped notice is
 *            replayed, so a drop is a delay).
 *   Hostile  a second Prefill of a lease (retry, replay) with other content; a request that
 *            names another request's page as its destination; with -DFOREIGN a second decode
 *            instance calling the broker for this decode's pool (Release, a KeepAlive without
 *            its owners, renewals of holders not its own), refused by instance identity.
 *
 * Properties (every reachable state, exhaustively):
 *   P1 no foreign bytes   a reader consumes a page only if every token cell it reads was
 *                         written under its own lease (owner, epoch, generation)
 *   P2 one live lease     no two requests are live readers of one page; a grant takes a
 *                         FREE page only
 *   P3 no page lost       the FREE + LEASED + QUARANTINED gauges add up to NP and match
 *                         the page states
 *   P4 writer drained     no page is FREE (grantable) while a writer can still land a write
 *                         on it: the writer's acknowledgement, or its liveness expiry plus
 *                         lock_delay, came first (ground truth, not the broker's view); with
 *                         -DSTEP_WRITES decode's own step is such a writer
 *   P5 quarantine drains  faults stop (a budget): no terminal state keeps a page leased or
 *                         quarantined (process Drained), and LTL `drains`:
 *                         [](QUARANTINED(p) -> <> FREE(p)) for every page
 *   P6 own bytes in transit  a one-sided data write stores the KV of the request whose lease
 *                         it writes under (prefill's source page was not reused under it)
 *   With -DPREFIX, P1 for a shared page is by content: every cell it reads is KV of the reader's own (scope,
 *   position, tokens); P2 allows two readers of one CACHED page that counts both, and a live reader's page is
 *   never FREE; P5's end state may keep unread cached pages; and
 *   P7 no false alarm     a re-check refuses a running request only when the broker ended its lease (revoked
 *                         it, or restarted) or a writer is active on its page: never a healthy shared or
 *                         published page (a false DATA_LOSS is a defect too)
 */

#ifndef NP
#define NP 2            /* pages in the decode pool */
#endif
#if defined(FAILOVER) && (defined(PREFIX) || defined(GROWTH) || defined(HEADROOM) || defined(FOREIGN))
#error "-DFAILOVER is modelled without prefix reuse, growth or a foreign instance"
#endif
#ifndef NR
#define NR 2            /* requests (each one prompt page of two token cells) */
#endif
#ifndef NW
#define NW 1            /* prefill processes; request r is prefilled by process r % NW */
#endif
#ifndef NSTEPS
#define NSTEPS 1        /* decode steps per request (one, taken at any time, covers all) */
#endif
#ifndef FAULTS
#define FAULTS 1        /* fault budget shared by every kind of fault: faults stop */
#endif
/* decode's path per request (bit r of each mask): Run (RUNPATH) or the old Allocate + Decode
 * (neither), or either, chosen at the grant (ANYPATH). Exploring the choice for both requests
 * costs 4.5x the states: check.sh runs r0 on Run and r1 on the old path, both on Run in one run,
 * and the free choice only with FORMAL_DEEP=1 */
#ifndef RUNPATH
#define RUNPATH 1
#endif
#ifndef ANYPATH
#define ANYPATH 0
#endif
/* issue 20 (prefix reuse), its own run: -DPREFIX. R1ID: the content identity of r1's page (0: r0's, shared;
 * 1: another scope, the same tokens; 2: the same scope and page tokens at another offset; 3: chosen) */
#ifdef PREFIX
#ifndef R1ID
#define R1ID 3
#endif
/* decode's own writes (-DSTEP_WRITES, -DGROWTH) go to its exclusive last page, which this variant leaves out;
 * expiry, lease expiry and the foreign instance's calls are not modelled with shares */
#if defined(STEP_WRITES) || defined(GROWTH) || defined(EXPIRY) || defined(LEASE_FAULTS) || defined(FOREIGN) || NR != 2 || NP != 2
#error "-DPREFIX runs with NR=2, NP=2 and none of STEP_WRITES, GROWTH, EXPIRY, LEASE_FAULTS, FOREIGN"
#endif
#endif
/* issue 19 (pages on demand), its own run (check.sh): -DGROWTH. A growing request's prompt fills its
 * page; every token it generates goes into a growth page that decode leases from the broker by Extend
 * (one call for many owners: each item on its own) and writes itself, so -DGROWTH implies -DSTEP_WRITES.
 * GROWS: bit r, request r grows (the others step over their prompt page as before); NGSTEPS: steps of
 * a growing request, step i writing cell i of its growth page (the second reads the first one's KV) */
#ifdef HEADROOM
#define GROWTH
#endif
#ifdef GROWTH
#ifndef STEP_WRITES
#define STEP_WRITES
#endif
#ifndef GROWS
#define GROWS 1
#endif
#ifndef NGSTEPS
#define NGSTEPS 2
#endif
#define GROWER(r) ((GROWS >> (r)) & 1)
#endif
/* issue 18, each in its own run (check.sh): -DEXPIRY (allocation expiry as a process racing the
 * reader's take), -DSTEP_WRITES (a decode step checks, then writes its page later; the reader's
 * acknowledgement of a revocation), -DFOREIGN (a second decode instance calls the broker for this
 * decode's pool; with instance identity every such call is refused and changes nothing, so only its
 * mutant runs it) */

#define NONE   255
#ifdef PREFIX
mtype = { cached, free, leased, quarantined, done, failed }  /* names for the trace only */
#define PSTATE(x) ((x) == CACHED -> 6 : 5 - (x))     /* page state -> its mtype name */
#else
mtype = { free, leased, quarantined, done, failed }  /* names for the trace only */
#define PSTATE(x) (5 - (x))                          /* page state -> its mtype name */
#endif
#define PRESULT(x) (3 - (x))                         /* prefill result -> its mtype name */
#define FREE   0        /* page states */
#define LEASED 1
#define QUAR   2
#define CACHED 3        /* (-DPREFIX) a published prompt page: read-only, shared by its readers */
#define PROC(r) ((r) % NW)
/* writer ids (BeginWrite's writer_id, the liveness lease's holder): by default one per
 * prefill process, as DESIGN §3 describes; -DWRITER_PER_WRITE gives every write its own id
 * and liveness lease, as services/prefill/servicer.py does ("<worker>/<owner>"), whose
 * renewals stop when the write ends */
#ifdef WRITER_PER_WRITE
#define NWID NR
#define WID(r) (r)
#define WPROC(x) PROC(x)
#else
#define NWID NW
#define WID(r) PROC(r)
#define WPROC(x) (x)
#endif
#define OLDW   (NWID+1) /* active-writer mark of pages quarantined by a broker restart */
#define REVW   (NWID+2) /* active-writer mark of a revoked reader's pages (revoke())   */
#define FAILW  (NWID+3) /* active-writer mark of a failed write's pages until the bound */
#define BADW   (NWID+4) /* (-DPREFIX) mark of an unpublished (bad) cached page in quarantine */
#define ADPW   (NWID+5) /* (-DFAILOVER) mark of a lease adopted at a failover: an old-term writer, or a
                           step of an owner the old leader revoked, may still write its page */
#define DONE   1        /* prefill results */
#define FAILED 2

/* the identity of a lease, also the "bytes" a write under that lease stores */
#define STAMP(r,e,g)   (((r)+1)*32 + (e)*16 + (g))
/* + OTHER: the bytes of another prompt, written under that lease by a replayed Prefill; the
 * tag's ownership words are the stamp modulo OTHER, its checksum covers the whole stamp */
#define OTHER          128
#define WORDS(st)      ((st) % OTHER)
/* for the trace: a stamp printed as owner/epoch/generation ("r-1" = a previous tenant,
 * "r4"/"r5" = another prompt's bytes written under r0's/r1's lease) */
#define SHOW(st)       ((st)/32) - 1, ((st)/16) % 2, (st) % 16

/* ---------------- broker (services/broker/lease_table.py) ---------------- */
byte epoch;                      /* 0, then 1 after the one restart */
byte genctr;                     /* PoolPages.next_generation - 1 */
byte pst[NP];                    /* Page.state */
byte powner[NP];                 /* Page.owner (request index) */
byte pgen[NP];                   /* Page.generation */
byte paw[NP];                    /* Page.active_writer: 0 none, writer id + 1, OLDW or REVW */
byte pawgen[NP];                 /*   ... and its generation */
#ifdef PREFIX
byte npst[4];                    /* pool_state / pdserve_kv_pages{state} gauges, num_cached */
#else
byte npst[3];                    /* pool_state / pdserve_kv_pages{state} gauges */
#endif
bit restarted, olddrained;       /* decode moved to a new broker incarnation; the move's wait ended */
/* the old incarnation may still run (a rolling update, a partition, a terminating pod): */
bit oldfenced;                   /* reader_ttl passed since decode's last contact with it: it refuses
                                    BeginWrite and writer renewals on the pool (its reader expired) */
bit oldwdead;                    /* + the longest writer ttl: every old-epoch writer's liveness lapsed */
bit oldcur[NR];                  /* the old table still holds r's lease, unwritten: BeginWrite there */
bit latebegin[NR];               /* (mutant) the old broker accepted r's write after oldwdead */
bit pwrit[NP];                   /* a write began on the page's current generation */
#ifdef FAILOVER
bit failedover;                  /* a new leader took over (term 1); the old one's authority had ended */
bit nseen[NW];                   /* prefill process has seen the new term (an answer of the new leader) */
bit wterm[NR];                   /* the term whose BeginWrite started r's write's liveness */
bit gdel[NR];                    /* r's Grant reply has reached decode */
bit gold[NR];                    /* r's Grant was decided by the old leader, its reply still on its way */
bit unclaimed[NR];               /* decode held r at the hand-over and left it out of its claim: r must end */
#endif

/* ---------------- decode's pool memory (never zeroed) ---------------- */
byte d0[NP], d1[NP];             /* stamp of the write that last stored each token cell */
byte tstamp[NP];                 /* tag: owner, epoch, generation, page_index (one stamp) */
byte tntok[NP];                  /* tag: num_tokens; checksum = the stamp over ntok cells */

/* ---------------- per request ---------------- */
byte rpage[NR];                  /* leased page (NONE before the grant) */
byte rgen[NR], rep[NR], rstamp[NR];
byte result[NR];                 /* prefill's answer to decode */
bit  rvq[NR];                    /* revocation notice in flight (WatchRevocations) */
bit  revoked[NR];                /* decode knows the lease is gone */
bit  reading[NR];                /* passed Validate, not yet released */
bit  rdone[NR], wfin[NR];        /* reader / writer finished */
byte pend_data[NR];              /* one-sided data write in flight: cells it stores */
bit  pend_tag[NR];               /* one-sided tag write in flight */
byte ptntok[NR];                 /*   ... its num_tokens */
byte wsrc[NR];                   /* what prefill's source page of that write holds now (a stamp) */
bit  wposted[NR];                /* the writer posted a write (EndWrite's nothing_posted = !this) */
bit  wmis[NR];                   /* the data write goes to the page the request named (mutant) */
bit  canpost[NR];                /* BeginWrite answered OK, writes not posted yet */
bit  werr[NR];                   /* transfer reported an error to the writer */
byte ackq[NR];                   /* EndWrite copies in flight */
bit  ackdone[NR];                /* the broker answered an EndWrite */
bit  wok[NR];                    /* EndWrite's success flag as prefill sent it */
/* Decode.Run and the write-done notice (Revocation.write_done) on the pool's revocation stream */
bit  rrun[NR];                   /* decode serves r by Run (chosen at the grant) */
bit  wdq[NR];                    /* r's write-done notice is on the stream, not yet delivered */
bit  wdd[NR];                    /* decode has r's write-done notice */
bit  wdx[NR];                    /*   ... and its prompt digest is another prompt's (a replayed Prefill) */
bit  wdlate[NR];                 /*   ... it was logged after a revocation of r still on the stream */
#ifdef EXPIRY
/* decode's allocation table (one owner: take / expire hand each allocation out once) */
bit  atab[NR];                   /* r's allocation is in it: granted, not yet taken (by Decode / Run or expiry) */
#ifdef MUT_EXPIRY_SNAPSHOT
bit  esnap[NR];                  /* (mutant) expiry's snapshot of the table holds r's allocation */
#endif
#endif
#ifdef GROWTH
/* 0: no step in flight; 1: a step over the prompt page; 2 + i: growth step i (it writes cell i of gpage) */
byte stepping[NR];
#elif defined(STEP_WRITES)
bit  stepping[NR];               /* r's step passed its check and has not yet written its own KV */
#endif
#ifdef STEP_WRITES
bit  unheld[NR];                 /* decode dropped r's allocation on a revocation (no notice yet): KeepAlive omits r */
#endif
#ifdef GROWTH
/* pages on demand: the broker's view (the owner's lease list) and decode's (what an Extend reply gave it) */
byte bg[NR];                     /* growth page the broker leased to r by Extend (NONE: none) */
byte bggen[NR];                  /*   ... at this generation */
bit  xsent[NR];                  /* r's item of an Extend call is on its way to the broker */
byte xrep[NR];                   /* its reply, not yet applied by decode: XGRANTED, XDRY or XREFUSED */
byte gpage[NR];                  /* the growth page decode holds for r (from the reply; NONE: none yet) */
byte gstamp[NR];                 /*   ... its lease (owner, epoch, generation) as decode stamps and checks it */
#define XGRANTED 1
#define XDRY     2               /* POOL_EXHAUSTED: decode may ask again, wait, or preempt */
#define XREFUSED 3               /* OWNER_NOT_LEASED, or the epoch is not current: the request ends */
#endif
#ifdef FOREIGN
/* what the other decode instance's calls did, when the broker accepted them (mutant only) */
bit  fack[NR];                   /* its KeepAlive without r counts as decode's acknowledgement of r */
bit  frenew;                     /* it keeps renewing the holders of held pages (revoked/, failed/, earlier-epoch/) */
bit  foldpool;                   /* it keeps renewing the old incarnation's reader record after the move */
#endif

#ifdef PREFIX
/* prefix reuse (issue 20). A request's modelled page is its first full prompt page, the one a chain key names;
 * its other pages (the last one, where decode writes) are exclusive and follow every rule above unchanged.
 * Content identity of that page, (scope, position, tokens), as a small number: ID0 = (scope A, page 0, tokens
 * T), ID1 = (scope B, page 0, T): another tenant or cache_salt, the same tokens; ID2 = (scope A, page 1 after a
 * page U, T): the same page tokens at another offset. r0 is ID0; r1 is R1ID (3: chosen at the start) */
#define NOCONT 255
byte cid[NR];                    /* content identity of r's page (what its KV is) */
bit  rsh[NR];                    /* r reads its page as a share of a cached page (GrantResponse.num_shared) */
/* the broker's cached pages: PoolPages' chain index, readers, published checksums */
bit  pidx[NP];                   /* in the chain index (a Grant may share it) */
byte pkey[NP];                   /* its chain key, as Publish gave it */
byte pscope[NP];                 /* its scope tag */
byte pck[NP];                    /* the published checksum (the bytes decode verified: a stamp) */
byte prd[NP];                    /* readers (bit r): the owner from Publish, then each Grant that shared it */
byte prv[NP];                    /* revoked readers (bit r) not yet swept: the page stays unevictable */
/* the revocation stream's outages (each once per run: a network event, not a fault of the budget) */
bit  reconnected;                /* the stream reconnected: decode re-checked every running request */
bit  gapped;                     /* the stream reported a gap: a revocation notice is lost for good */
bit  bended[NR];                 /* ghost: the broker ended r's lease (revoke, restart): a refusal is honest */
#endif

/* ---------------- prefill processes and writer liveness ---------------- */
bit wcrashed[NW];                /* process crashed */
bit wexp[NWID];                  /* writer's liveness lease expired (it posts nothing more) */
bit wdrained[NWID];              /* expired + lock_delay: none of its writes can land */

byte budget = FAULTS;
byte k;                          /* loop index inside atomic sequences only; 0 between steps */

/* ====================== guards, one per DESIGN §3 rule ======================
 * Each MUT_* flag removes or weakens exactly one. */

#ifdef MUT_RESTART_KEEPS
#define EPOK(r) 1                                   /* old-epoch leases keep validating */
#else
#define EPOK(r) (rep[r] == epoch)
#endif

#define LEASE_CUR(r) (rpage[r] != NONE && pst[rpage[r]] == LEASED && powner[rpage[r]] == (r) \
                      && pgen[rpage[r]] == rgen[r] && EPOK(r))
/* the owner holds leases in the pool (LeaseTable's pool.owners[owner] is not empty): its prompt page, or
 * a growth page the broker leased it (at the owner's epoch: Extend is refused at any other) */
#ifdef GROWTH
#define BG_CUR(r) (bg[r] != NONE && pst[bg[r]] == LEASED && powner[bg[r]] == (r) && pgen[bg[r]] == bggen[r] \
                   && EPOK(r))
#define HOLDS(r) (LEASE_CUR(r) || BG_CUR(r))
#elif defined(PREFIX)
#define HOLDS(r) (LEASE_CUR(r) || SHARE_CUR(r))      /* a lease, or a share of a cached page */
#else
#define HOLDS(r) LEASE_CUR(r)
#endif

/* prefill's own liveness check before posting writes (with margin); a lease of an
 * earlier epoch no longer counts once the old incarnation's writers are presumed drained */
#if defined(MUT_NO_WRITER_FENCE)
#define WLIVE(r) 1
#elif defined(MUT_WRITER_IGNORES_EPOCH)
#define WLIVE(r) (!wexp[WID(r)])
#elif defined(FAILOVER) && (defined(MUT_FO_LIVENESS_ANY_TERM) || defined(MUT_FO_AUTH_PAST_LEASE))
#define WLIVE(r) (!wexp[WID(r)])                     /* an old-term write renewed past the old term's drain */
#elif defined(FAILOVER)
/* a write begun under the old term is renewed by that term's leader alone, which authorises nothing once its
 * authority ended (A8): it lapses with the old term's writers (oldwdead), whatever the new leader answers */
#define WLIVE(r) (!wexp[WID(r)] && (wterm[r] || !oldwdead))
#else
#define WLIVE(r) (!wexp[WID(r)] && (rep[r] == epoch || !oldwdead || latebegin[r]))
#endif

#ifdef FOREIGN
#define FOLDPOOL foldpool
#define FRENEW frenew
#else
#define FOLDPOOL 0
#define FRENEW 0
#endif
/* the old broker answers BeginWrite on its own table until its reader record of the pool expired
 * (oldfenced: reader_ttl since decode's last contact; a renewal by another instance keeps it alive) */
#ifdef MUT_OLD_BROKER_GRANTS
#define OLDOPEN 1                                    /* it keeps accepting writes on an expired reader */
#else
#define OLDOPEN (!oldfenced || FOLDPOOL)
#endif
#ifdef FAILOVER
/* the old leader answers BeginWrite only while its authority lasts (A8: it ended before the failover), and
 * prefill takes an answer of the old term only while it has seen no newer one */
#ifdef MUT_FO_AUTH_PAST_LEASE
#define FO_OLDOPEN 1                                 /* it authorises past its etcd lease */
#else
#define FO_OLDOPEN (!oldfenced)
#endif
#ifdef MUT_FO_BEGIN_IGNORES_TERM
#define FO_TERMOK(r) 1
#else
#define FO_TERMOK(r) (!nseen[PROC(r)])
#endif
#define OLD_BEGIN_OK(r) (failedover && oldcur[r] && FO_OLDOPEN && FO_TERMOK(r))
#else
#define OLD_BEGIN_OK(r) (restarted && rep[r] != epoch && oldcur[r] && OLDOPEN)
#endif
/* decode grants from the new incarnation only after the old one must have fenced the pool, every
 * writer it renewed has lapsed, and their writes have landed: reader_ttl + max_ttl + lock_delay */
#ifdef MUT_NO_FENCE_WAIT
#define FENCE_WAITED 1                               /* registers and grants at once */
#else
#define FENCE_WAITED oldwdead
#endif

/* ground truth: can request r's writer still land a byte in decode's pool? */
#define PENDING(r) (pend_data[r] > 0 || pend_tag[r])
#define INFLIGHT(r) (PENDING(r) || (canpost[r] && WLIVE(r)))

/* the enforced bound after a failed or timed-out write (EndWrite(success=false) + lock_delay):
 * every post came before that EndWrite, and a posted write lands within L <= lock_delay of its
 * post (README, A1, checked at start-up), so by then every one has landed: the event waits for them */
#define BOUND(r) (!PENDING(r))

/* prefill's source page of request x's write is free for the next request's forward pass */
#ifdef MUT_SOURCE_REUSE
#define SRCFREE(x) wfin[x]                          /* at once, when the write call returned */
#else
#define SRCFREE(x) (wfin[x] && BOUND(x))            /* once no posted write can read it */
#endif

/* BeginWrite: lease current, no writer active, and one write per lease generation (refused
 * once a write began on it; decode's Validate comes only after one did, see README) */
#ifdef MUT_REWRITE
#define BEGIN_OK(r) (LEASE_CUR(r) && paw[rpage[r]] == 0)
#else
#define BEGIN_OK(r) (LEASE_CUR(r) && paw[rpage[r]] == 0 && !pwrit[rpage[r]])
#endif

/* EndWrite(success=false) of a write that posted something keeps the pages "writing" (FAILW)
 * until the bound; nothing_posted or success frees them at once */
#ifdef MUT_FAIL_FREES
#define HOLD_FAILED(r) 0
#else
#define HOLD_FAILED(r) (werr[r] && wposted[r])
#endif

/* verify_prompt_pages */
#ifdef MUT_NO_TAG_MATCH
#define TAGOK(p,r) 1
#else
#define TAGOK(p,r) (WORDS(tstamp[p]) == rstamp[r])
#endif
#ifdef MUT_NO_COVERAGE
#define COVERAGE(p) 1
#else
#define COVERAGE(p) (tntok[p] == 2)                  /* num_tokens add up to the prompt */
#endif
#ifdef MUT_NO_CHECKSUM
#define CHECKSUM(p) 1
#else
#define CHECKSUM(p) (d0[p] == tstamp[p] && (tntok[p] < 2 || d1[p] == tstamp[p]))
#endif

/* broker Validate: leases current, no writer active */
#ifdef MUT_NO_VALIDATE
#define VALIDATE(r) 1
#else
#define VALIDATE(r) (LEASE_CUR(r) && paw[rpage[r]] == 0)
#endif

/* the check before every decode step: stop on revocation / epoch change, and
 * compare the tags of the pages the step reads with the leases */
#if defined(MUT_NO_STEP_CHECK)
#define GATE(r) 1
#elif defined(MUT_NO_REVOCATION_STOP)
#define GATE(r) (WORDS(tstamp[rpage[r]]) == rstamp[r])  /* tags only */
#elif defined(MUT_NO_STEP_TAGS)
#define GATE(r) (!revoked[r] && EPOK(r))                /* revocation only */
#else
#define GATE(r) (!revoked[r] && EPOK(r) && WORDS(tstamp[rpage[r]]) == rstamp[r])
#endif

/* EndWrite matches (writer, generation) */
#ifdef MUT_ACK_NO_GEN
#define ACKMATCH(p,r) (paw[p] == WID(r)+1)
#else
#define ACKMATCH(p,r) (paw[p] == WID(r)+1 && pawgen[p] == rgen[r])
#endif

/* the broker's write-done notice on EndWrite: success, the lease current (epoch included) and
 * this writer's BeginWrite the one active on it, all checked in the same step as EndWrite */
#if defined(MUT_NOTICE_UNCHECKED)
#define NOTICE_OK(p,r) wok[r]                         /* any successful EndWrite */
#elif defined(MUT_NOTICE_ON_FAILURE)
#define NOTICE_OK(p,r) (LEASE_CUR(r) && ACKMATCH(p, r)) /* whatever success says */
#else
#define NOTICE_OK(p,r) (wok[r] && LEASE_CUR(r) && ACKMATCH(p, r))
#endif
/* Run: decode takes a notice only if its prompt digest is the Run's (the bytes are this prompt's) */
#ifdef MUT_NOTICE_NO_PROMPT
#define PROMPTOK(r) 1
#else
#define PROMPTOK(r) (!wdx[r])
#endif
/* one ordered stream: a revocation of r logged after r's write-done notice is delivered after it */
#ifdef MUT_NOTICE_UNORDERED
#define AFTER_NOTICE(r) 1                             /* a revocation may overtake the notice */
#else
#define AFTER_NOTICE(r) (!(wdq[r] && !wdlate[r]))
#endif
/* a revocation that reaches a Run before its write-done notice: decode may drop it (the model
 * does: the worst case). One that comes after the notice ends the Run, even before it joins */
#ifdef MUT_RUN_DROPS_REVOCATION
#define DROPPED(r) (rrun[r] && !reading[r])            /* dropped until the Run joins the batch */
#else
#define DROPPED(r) (rrun[r] && !wdd[r] && !reading[r])
#endif
/* the blind stop ends every request decode holds, Runs waiting for their notice included */
#ifdef MUT_BLIND_SPARES_RUN
#define BLINDED(k) (!(rrun[k] && !wdd[k] && !reading[k]))
#else
#define BLINDED(k) 1
#endif
/* what a Run waits for before verify_prompt_pages */
#ifdef MUT_RUN_NO_NOTICE
#define RUN_READY(r) (result[r] == DONE)               /* prefill's own answer, relayed */
#else
#define RUN_READY(r) wdd[r]
#endif

#define LIVE_R(r) (reading[r] && !revoked[r] && EPOK(r))
#ifdef GROWTH
/* a growing reader's pages: its prompt page and the growth page decode holds for it */
#define TWO_LIVE(a,b) (LIVE_R(a) && LIVE_R(b) && (rpage[a] == rpage[b] || gpage[a] == rpage[b] \
                       || gpage[b] == rpage[a] || (gpage[a] != NONE && gpage[a] == gpage[b])))
#elif defined(PREFIX)
/* two readers of one page are fine only while it is CACHED and both are its readers */
#define TWO_LIVE(a,b) (LIVE_R(a) && LIVE_R(b) && rpage[a] == rpage[b] \
                       && !(pst[rpage[a]] == CACHED && READER(rpage[a], a) && READER(rpage[a], b)))
#else
#define TWO_LIVE(a,b) (LIVE_R(a) && LIVE_R(b) && rpage[a] == rpage[b])
#endif

#ifdef PREFIX
/* the chain key and the scope tag of a content identity, as decode computes them (page_chains over
 * chain_seed(scope), scope_tag(scope)) and the broker indexes them: injective in scope, position and tokens */
#if defined(MUT_SALT_IGNORED)
#define KEY(c) ((c) == 1 -> 0 : (c))                 /* the scope drops the tenant and cache_salt: ... */
#define SCOPE(c) 0                                   /* ... in the chain seed and in the scope tag */
#elif defined(MUT_CHAIN_WITHOUT_SALT)
#define KEY(c) ((c) == 1 -> 0 : (c))                 /* the chain seed without the scope; the tag keeps it */
#define SCOPE(c) ((c) == 1)
#elif defined(MUT_CHAIN_WITHOUT_POSITION)
#define KEY(c) ((c) == 2 -> 0 : (c))                 /* a page's own tokens only, not the chain before it */
#define SCOPE(c) ((c) == 1)
#else
#define KEY(c) (c)
#define SCOPE(c) ((c) == 1)
#endif
#ifdef MUT_NO_SCOPE_TAG
#define SCOPE_OK(p,r) 1
#else
#define SCOPE_OK(p,r) (pscope[p] == SCOPE(cid[r]))   /* Grant shares only within the scope tag */
#endif
/* what KV a stamp's bytes are: the content of the request whose lease wrote them (a previous tenant's and
 * another prompt's: none of ours) */
#define CONT(st) (((st) >= 32 && (st) < OTHER) -> cid[(st)/32 - 1] : NOCONT)
/* the tag's chain words: the key its writer computed (derived from the tag's ownership words) */
#define TCHAIN(st) ((WORDS(st) >= 32) -> KEY(cid[WORDS(st)/32 - 1]) : NOCONT)
#define READER(p,r) (((prd[p] | prv[p]) >> (r)) & 1)
#define SHARE_CUR(r) (rpage[r] != NONE && pst[rpage[r]] == CACHED && ((prd[rpage[r]] >> (r)) & 1) && EPOK(r))
#define HIT(p,r) (pst[p] == CACHED && pidx[p] && pkey[p] == KEY(cid[r]) && SCOPE_OK(p, r))
#if NP > 2
#define HITP(r) (HIT(0, r) -> 0 : (HIT(1, r) -> 1 : (HIT(2, r) -> 2 : NONE)))
#else
#define HITP(r) (HIT(0, r) -> 0 : (HIT(1, r) -> 1 : NONE))
#endif
/* decode's check of a shared page before it sends the destination: the tag against the shared lease, its chain
 * words against decode's own key, num_tokens, and the bytes' CRC against the published checksum */
#ifdef MUT_SHARED_UNCHECKED
#define SHARED_CRC(p) 1                              /* the tag only: no CRC against the published checksum */
#else
#define SHARED_CRC(p) (d0[p] == pck[p] && d1[p] == pck[p])
#endif
#define SHARED_OK(p,r) (WORDS(tstamp[p]) == pck[p] && TCHAIN(tstamp[p]) == KEY(cid[r]) && tntok[p] == 2 \
                        && SHARED_CRC(p))
/* Publish: only the owner's current lease, written (a write began on this generation and decode verified it),
 * its writer finished (no active writer: not a failed write's hold, not a write still in flight) */
#define PUBLISH_OK(r) (LEASE_CUR(r) && paw[rpage[r]] == 0 && pwrit[rpage[r]])
/* decode's re-check after its revocation stream reconnected or reported a gap (Validate, recheck=true): r's own
 * page LEASED to it with no writer, or a page it shares or published CACHED at the generation it read with r among
 * its readers (PoolPages.checked_pages with shares) */
#if defined(MUT_RECHECK_LEASED_ONLY)
#define RECHECK(r) (LEASE_CUR(r) && paw[rpage[r]] == 0)  /* exclusive leases only, as the first Validate */
#elif defined(MUT_RECHECK_IGNORES_READERS)
#define RECHECK(r) ((LEASE_CUR(r) && paw[rpage[r]] == 0) \
                    || (pst[rpage[r]] == CACHED && pgen[rpage[r]] == rgen[r] && EPOK(r)))  /* cached, by anyone */
#else
#define RECHECK(r) ((LEASE_CUR(r) && paw[rpage[r]] == 0) || (SHARE_CUR(r) && pgen[rpage[r]] == rgen[r]))
#endif
/* an unread cached page (no reader, no revoked reader decode may still step) may be evicted */
#ifdef MUT_EVICT_WHILE_READ
#define EVICTABLE(p) 1                               /* readers or not */
#else
#define EVICTABLE(p) (prd[p] == 0 && prv[p] == 0)
#endif
#endif

/* ============================== broker steps ============================== */

inline setpst(pp, s) {
  npst[pst[pp]]--; pst[pp] = s; npst[s]++
}


/* LeaseTable.grant (one page): lowest free page, fresh generation. With -DHEADROOM a growing request's
 * Grant also leases its headroom page (its growth page, written by decode alone), all or nothing, at the
 * same generation; sealed at once, as Extend seals its pages, so no BeginWrite may name it */
#ifdef HEADROOM
#define NEED(r) (1 + GROWER(r))
#ifdef MUT_HEADROOM_UNSEALED
#define HEADROOM_SEALED 0            /* only the pages a BeginWrite or Validate names are sealed (the code) */
#else
#define HEADROOM_SEALED 1
#endif
#else
#define NEED(r) 1
#endif
inline grant(r) {
  p = 0;
  do
  :: p < NP - 1 && pst[p] != FREE -> p++
  :: else -> break
  od;
  assert(pst[p] == FREE);                            /* P2 */
#ifdef MUT_SAMEGEN
  if
  :: pgen[p] == 0 -> genctr++; pgen[p] = genctr      /* a re-grant keeps the page's generation */
  :: else
  fi;
#else
  genctr++; pgen[p] = genctr;
#endif
  setpst(p, LEASED); powner[p] = r; pwrit[p] = 0;
  rpage[r] = p; rgen[r] = pgen[p]; rep[r] = epoch; rstamp[r] = STAMP(r, epoch, pgen[p]);
  printf("GRANT     r%d gets page %d, lease r%d/e%d/g%d\n", r, p, SHOW(rstamp[r]));
#ifdef HEADROOM
  if                                                 /* + the headroom page, at the same generation */
  :: GROWER(r) ->
     p = 0;
     do
     :: p < NP - 1 && pst[p] != FREE -> p++
     :: else -> break
     od;
     assert(pst[p] == FREE);                         /* P2 */
     pgen[p] = genctr; setpst(p, LEASED); powner[p] = r; pwrit[p] = HEADROOM_SEALED;
     bg[r] = p; bggen[r] = genctr; gpage[r] = p; gstamp[r] = rstamp[r];
     printf("GRANT     r%d gets headroom page %d, lease r%d/e%d/g%d\n", r, p, SHOW(rstamp[r]))
  :: else
  fi;
#endif
  p = 0
}

/* LeaseTable._end_leases (release and revoke) */
inline end_lease(pp) {
#ifdef MUT_REGRANT
  paw[pp] = 0; setpst(pp, FREE)                      /* free at once, writer or not */
#else
  if
  :: paw[pp] != 0 -> setpst(pp, QUAR)
  :: else -> setpst(pp, FREE)
  fi
#endif
}

/* LeaseTable.revoke: the holder has not let go and may be mid-step until the revocation
 * reaches it, so its pages go through quarantine too (a holder already expired) */
#ifdef MUT_REVOKE_SPARES_GROWTH
#define REVOKE_SPARES_GROWTH 1                       /* Revoke ends only the pages of the owner's Grant */
#else
#define REVOKE_SPARES_GROWTH 0
#endif
#ifdef PREFIX
/* one reader's share ends; a cached page out of the index (unpublished) with no reader left goes to quarantine */
inline unread(pp) {
  if
  :: prd[pp] == 0 && prv[pp] == 0 && !pidx[pp] -> setpst(pp, QUAR); paw[pp] = BADW;
     printf("CACHE     page %d: out of the index and unread, quarantined\n", pp)
  :: else
  fi
}
inline drop_share(r) {
  prd[rpage[r]] = prd[rpage[r]] & ~(1 << (r)); unread(rpage[r]);
  printf("CACHE     r%d's share of page %d ends (readers now %d)\n", r, rpage[r], prd[rpage[r]])
}
#endif
inline revoke(r) {
#ifdef PREFIX
  bended[r] = 1;
  if                                                 /* a reader of a cached page: only its share ends, ... */
  :: SHARE_CUR(r) ->
#ifdef MUT_REVOKE_FREES_SHARED
     drop_share(r)
#else
     prd[rpage[r]] = prd[rpage[r]] & ~(1 << (r));    /* ... but it may step until the notice reaches it: */
     prv[rpage[r]] = prv[rpage[r]] | (1 << (r))      /* the page stays unevictable as quarantine would */
#endif
  :: else ->
#endif
#ifdef GROWTH
  if                                                 /* by owner: its growth page goes the same way */
  :: BG_CUR(r) && !REVOKE_SPARES_GROWTH ->
#ifndef MUT_REVOKE_FREES
     if
     :: paw[bg[r]] == 0 -> paw[bg[r]] = REVW
     :: else
     fi;
#endif
     end_lease(bg[r])
  :: else
  fi;
  if
  :: LEASE_CUR(r) ->
#endif
#ifndef MUT_REVOKE_FREES
  if
  :: paw[rpage[r]] == 0 -> paw[rpage[r]] = REVW
  :: else
  fi;
#endif
  end_lease(rpage[r])
#ifdef GROWTH
  :: else
  fi
#endif
#ifdef PREFIX
  fi
#endif
  ; rvq[r] = 1
}

inline release(r) {
  if
#ifdef PREFIX
#ifdef MUT_RELEASE_ENDS_SHARED
  :: SHARE_CUR(r) -> pidx[rpage[r]] = 0; prd[rpage[r]] = 0; prv[rpage[r]] = 0; setpst(rpage[r], FREE);
     printf("RELEASE   r%d: cached page %d is now free, its other readers' shares with it\n", r, rpage[r])
#else
  :: SHARE_CUR(r) -> drop_share(r)                   /* Release of a reader removes only its share */
#endif
#endif
  :: LEASE_CUR(r) -> end_lease(rpage[r]);
     printf("RELEASE   r%d: page %d is now %e\n", r, rpage[r], PSTATE(pst[rpage[r]]))
  :: else                                            /* gone already, or an old epoch */
  fi
#ifdef GROWTH
  ;
  if                                                 /* Release is by owner: its growth page too */
  :: BG_CUR(r) -> end_lease(bg[r]);
     printf("RELEASE   r%d: growth page %d is now %e\n", r, bg[r], PSTATE(pst[bg[r]]))
  :: else
  fi
#endif
}

#ifdef GROWTH
/* LeaseTable.extend, one item (owner r, one page): refused unless the epoch is current and the owner holds
 * leases in the pool now; POOL_EXHAUSTED without a FREE page; else the lowest free page, a fresh
 * generation, sealed at once (decode alone writes a growth page: no BeginWrite may name it), appended to
 * the owner's lease list. The reply of a request decode has ended is dropped by decode: not kept */
#ifdef MUT_EXTEND_REVOKED_OWNER
#define EXTEND_OK(r) (rep[r] == epoch && rpage[r] != NONE)  /* any owner ever granted here */
#else
#define EXTEND_OK(r) (rep[r] == epoch && HOLDS(r))
#endif
#ifdef MUT_GROWTH_UNSEALED
#define SEALED 0                                     /* a growth page takes a BeginWrite like a prompt page */
#else
#define SEALED 1
#endif
inline extend(r) {
  xsent[r] = 0;
  if
  :: EXTEND_OK(r) && npst[FREE] > 0 ->
     p = 0;
     do
     :: p < NP - 1 && pst[p] != FREE -> p++
     :: else -> break
     od;
     assert(pst[p] == FREE);                         /* P2 */
     genctr++; pgen[p] = genctr;
     setpst(p, LEASED); powner[p] = r; pwrit[p] = SEALED;
     bg[r] = p; bggen[r] = genctr;
     if
     :: !rdone[r] -> xrep[r] = XGRANTED
     :: else
     fi;
     printf("EXTEND    r%d gets growth page %d, lease r%d/e%d/g%d\n", r, p, SHOW(STAMP(r, epoch, genctr)));
     p = 0
  :: EXTEND_OK(r) && npst[FREE] == 0 ->
     if :: !rdone[r] -> xrep[r] = XDRY :: else fi;
     printf("EXTEND    r%d refused: POOL_EXHAUSTED\n", r)
  :: else ->
     if :: !rdone[r] -> xrep[r] = XREFUSED :: else fi;
     printf("EXTEND    r%d refused: the owner holds no leases (or the epoch is not current)\n", r)
  fi
}
#endif

#ifdef PREFIX
/* LeaseTable.publish (decode, after verifying the pages prefill wrote): the page becomes CACHED, indexed under
 * decode's chain key and scope tag with decode's checksum, its owner the first reader; refused otherwise */
inline publish(r) {
  p = rpage[r];
  if
  :: PUBLISH_OK(r) ->
     setpst(p, CACHED); pidx[p] = 1; pkey[p] = KEY(cid[r]); pscope[p] = SCOPE(cid[r]); pck[p] = rstamp[r];
     prd[p] = 1 << (r);
     printf("PUBLISH   r%d's page %d is cached: key %d, scope %d, checksum r%d/e%d/g%d\n", r, p, pkey[p], pscope[p],
            SHOW(pck[p]))
  :: else -> printf("PUBLISH   r%d's page %d refused\n", r, p)
  fi;
  p = 0
}
/* Grant with prefix_chains and scope_tag: the leading page is shared when the index has its key in the scope */
inline share(r, pp) {
  prd[pp] = prd[pp] | (1 << (r)); rpage[r] = pp; rsh[r] = 1; rep[r] = epoch; rgen[r] = pgen[pp];
  rstamp[r] = pck[pp];                               /* the shared lease, as decode checks the tag against it */
  printf("GRANT     r%d shares cached page %d (key %d, lease r%d/e%d/g%d)\n", r, pp, pkey[pp], SHOW(pck[pp]))
}
/* Unpublish of a bad page: out of the index; quarantined once no reader is left */
inline unpublish(r) {
  pidx[rpage[r]] = 0; printf("UNPUBLISH page %d\n", rpage[r]); drop_share(r)
}
#endif

/* the write-done notice of r's write (other: another prompt's), logged on the pool's revocation
 * stream after every revocation of r logged before it. Only a Run waits for it: for an old-path
 * request decode ignores it, so it is not logged (fewer states, no behaviour lost) */
inline notice(r, other) {
  wdq[r] = 1; wdx[r] = other; wdlate[r] = rvq[r];
  printf("WRITEDONE r%d's write-done notice logged (another prompt's digest: %d)\n", r, other)
}

/* LeaseTable.end_write */
inline end_write(r) {
  p = rpage[r];
  if                                                 /* checked before the write is cleared */
  :: rrun[r] && !wdq[r] && !wdd[r] && NOTICE_OK(p, r) -> notice(r, 0)
  :: else
  fi;
  if
  :: EPOK(r) && ACKMATCH(p, r) && HOLD_FAILED(r) ->
     paw[p] = FAILW;                                 /* its writes may land until the bound */
#ifdef MUT_FAILED_WRITE_VISIBLE
     /* the broker indexes a failed write's page under the chain the Grant named, its hold still on */
     if
     :: pst[p] == LEASED -> setpst(p, CACHED); pidx[p] = 1; pkey[p] = KEY(cid[r]); pscope[p] = SCOPE(cid[r]);
        pck[p] = rstamp[r]; printf("PUBLISH   r%d's page %d is cached as its write ends (failed)\n", r, p)
     :: else
     fi;
#endif
     printf("ENDWRITE  of r%d (g%d, failed after posting): page %d stays writing until the bound\n", r, rgen[r], p)
  :: EPOK(r) && ACKMATCH(p, r) && !HOLD_FAILED(r) ->
     paw[p] = 0;
     if
     :: pst[p] == QUAR -> setpst(p, FREE)
     :: else
     fi;
     printf("ENDWRITE  of r%d (g%d, ok=%d) matches page %d: writer cleared, page %e\n", r, rgen[r], !werr[r], p, PSTATE(pst[p]))
  :: else                                            /* late, repeated or old-epoch ack */
     printf("ENDWRITE  of r%d (g%d) changes nothing\n", r, rgen[r])
  fi;
  ackdone[r] = 1;
  p = 0
}

/* decode moves to a new LeaseTable (a new epoch): it registers a new pool incarnation and fails
 * in-flight requests; the old table may live on (oldcur, OLD_BEGIN_OK) */
inline restart() {
  printf("RESTART   broker restarts: epoch 1, generations restart\n");
  k = 0;
  do                                                 /* before the epoch changes: the old table's view */
  :: k < NR -> oldcur[k] = (rpage[k] != NONE && LEASE_CUR(k) && paw[rpage[k]] == 0 && !pwrit[rpage[k]]); k++
  :: else -> break
  od;
  restarted = 1; epoch = 1; genctr = 0;
  k = 0;
  do
  :: k < NP ->
#if defined(MUT_RESTART_KEEPS)
     /* decode hands its leases to the new broker, which cannot know their writers */
     if
     :: pst[k] == LEASED -> paw[k] = 0
     :: pst[k] == QUAR -> paw[k] = OLDW
     :: else
     fi;
#elif defined(MUT_RESTART_HELDONLY)
     /* only the pages decode held go through quarantine */
     if
     :: pst[k] == LEASED -> setpst(k, QUAR); paw[k] = OLDW
     :: else -> setpst(k, FREE); paw[k] = 0
     fi;
     pgen[k] = 0;
#else
     setpst(k, QUAR); paw[k] = OLDW; pgen[k] = 0;    /* every page, until the old writers drained */
#endif
#ifdef PREFIX
     pidx[k] = 0; prd[k] = 0; prv[k] = 0;            /* the new incarnation's index is empty */
     if :: k < NR -> bended[k] = 1 :: else fi;       /* NP == NR here: every request's lease ended */
#endif
     k++
  :: else -> break
  od;
  k = 0
}

/* a write of the old incarnation (restart: its epoch; failover: begun under the old term) */
#ifdef FAILOVER
#define OLD_WRITE(k) (!wterm[k])
#else
#define OLD_WRITE(k) (rep[k] == 0)
#endif
/* the old incarnation's writer leases expired and lock_delay passed */
inline olddrain() {
  printf("DRAINED   decode's wait since the move ended: old writers' writes landed (if their liveness lapsed)\n");
  olddrained = 1;
  k = 0;
  do
  :: k < NR ->
     if
     :: rpage[k] != NONE && OLD_WRITE(k) && (pend_data[k] > 0 || pend_tag[k]) && oldwdead && !latebegin[k] ->
        pend_data[k] = 0; pend_tag[k] = 0; werr[k] = 1
     :: else
     fi;
     k++
  :: else -> break
  od;
  k = 0
}

#ifdef FAILOVER
/* decode holds r (the leases it hands over to a new leader): it has the Grant's reply and has not ended r (with
 * -DSTEP_WRITES, nor dropped r's allocation on a revocation) */
#ifdef STEP_WRITES
#define CLAIMED(r) (rpage[r] != NONE && gdel[r] && !rdone[r] && !unheld[r] && !unclaimed[r])
#else
#define CLAIMED(r) (rpage[r] != NONE && gdel[r] && !rdone[r] && !unclaimed[r])
#endif
#define ADOPTS(pp) (CLAIMED(powner[pp]) && rpage[powner[pp]] == (pp))
#ifdef MUT_FO_CLAIM_UNVERIFIED_WRITTEN
#define MUT_FO_CLAIM_UNVERIFIED 1    /* every claimed page adopted as written, the unverified ones too */
#else
#define MUT_FO_CLAIM_UNVERIFIED 0
#endif
/* the leader's authority ended (it could not renew its etcd lease: killed, partitioned, paused) and a standby
 * won the election at a newer term; decode registers with it, handing over the leases it holds. The new leader
 * knows the lease identities (epoch, generation counter) and the durable free set, not who writes what:
 *   - a page decode claims stays its owner's, sealed (no BeginWrite), with an old-term writer (or a step of an
 *     owner the old leader revoked) possibly still on it: ADPW, freed after the old term drained and decode's
 *     acknowledgement;
 *   - a page the old leader had free is free at once if it is in the durable free set, which a page leaves
 *     (reserved) before it can be granted: either way here;
 *   - every other page waits in quarantine until the old term's writes drained (OLDW).
 * Write-done notices the old leader logged and decode has not received are lost (a Run waiting for one is
 * cancelled); a Grant the old leader decided whose reply is still on its way is refused by decode (gold). */
inline failover() {
  printf("FAILOVER  the leader's authority ended; a standby leads at term 1 and adopts the leases decode holds\n");
  k = 0;
  do
  :: k < NR ->
     oldcur[k] = (rpage[k] != NONE && LEASE_CUR(k) && paw[rpage[k]] == 0 && !pwrit[rpage[k]]);
     gold[k] = (rpage[k] != NONE && !gdel[k]);
     wdq[k] = 0;
#ifdef CLAIM_SUBSET
     /* the code claims the requests decoding and ends the others (BROKER_FAILOVER): any held request not yet
      * reading may be left out, its page then nobody's (quarantine below) */
     if
     :: CLAIMED(k) && !reading[k] -> if :: skip :: unclaimed[k] = 1 fi
     :: else
     fi;
#endif
     k++
  :: else -> break
  od;
  failedover = 1; oldfenced = 1;
  k = 0;
  do
  :: k < NP ->
     if
#ifdef MUT_FO_ADOPT_FREE
     :: pst[k] != FREE && !ADOPTS(k) -> paw[k] = 0; setpst(k, FREE)   /* nobody claims it: free at once */
#endif
#if defined(MUT_FO_ADOPT_NO_WRITER)
     :: pst[k] != FREE && ADOPTS(k) -> setpst(k, LEASED); paw[k] = 0; pwrit[k] = 1;   /* as if nobody wrote */
#elif defined(MUT_FO_ADOPT_UNSEALED)
     :: pst[k] != FREE && ADOPTS(k) -> setpst(k, LEASED); paw[k] = ADPW; pwrit[k] = 0; /* a BeginWrite may follow */
#elif defined(CLAIM_SUBSET)
     /* the code's claim: a request decoding verified its pages against the acknowledged write, which nothing
      * can begin again (sealed): adopted as written, with no writer; a held request not reading as above */
     :: pst[k] != FREE && ADOPTS(k) && (reading[powner[k]] || MUT_FO_CLAIM_UNVERIFIED) -> setpst(k, LEASED);
        paw[k] = 0; pwrit[k] = 1;
     :: pst[k] != FREE && ADOPTS(k) && !(reading[powner[k]] || MUT_FO_CLAIM_UNVERIFIED) -> setpst(k, LEASED);
        paw[k] = ADPW; pwrit[k] = 1;
#else
     :: pst[k] != FREE && ADOPTS(k) -> setpst(k, LEASED); paw[k] = ADPW; pwrit[k] = 1;
#endif
        printf("ADOPT     page %d stays r%d's at g%d, sealed\n", k, powner[k], pgen[k])
     :: pst[k] == FREE                               /* in the durable free set */
     :: pst[k] == FREE -> setpst(k, QUAR); paw[k] = OLDW   /* reserved: the old leader may have granted it */
     :: else -> setpst(k, QUAR); paw[k] = OLDW       /* nobody claims it: an old-term write may still land */
     fi;
     k++
  :: else -> break
  od;
  k = 0
}
#endif

/* writer x's liveness expired and lock_delay passed: nothing of it lands any more (it posts only
 * while live, and a post lands within L <= lock_delay: README, A1) */
inline drain(x) {
  printf("DRAINED   writer w%d: liveness expired + lock_delay, its writes are over\n", x);
  wexp[x] = 1; wdrained[x] = 1;
  k = 0;
  do
  :: k < NR ->
     if
     :: WID(k) == x && (pend_data[k] > 0 || pend_tag[k]) ->
        pend_data[k] = 0; pend_tag[k] = 0; werr[k] = 1
     :: else
     fi;
     k++
  :: else -> break
  od;
  k = 0
}

/* decode stops stepping every running request (UNAVAILABLE) when it has heard nothing on its
 * revocation stream (revocations, heartbeats) for longer than a bound under lock_delay */
inline blind_stop() {
  printf("BLIND     decode heard nothing on the stream since the revocation for longer than the bound: it stops every running request\n");
  k = 0;
  do
  :: k < NR ->
     if
     :: rpage[k] != NONE && !rdone[k] && BLINDED(k) -> revoked[k] = 1
     :: else
     fi;
     k++
  :: else -> break
  od;
  k = 0
}

#ifdef PREFIX
/* decode re-checks a running request (watch.recheck_leases): a refusal ends it (DATA_LOSS), and must be honest */
inline recheck(o) {
  if
  :: reading[o] && !revoked[o] && !rdone[o] ->
     printf("RECHECK   r%d page %d (%e, readers %d, g%d; lease g%d) -> %d\n", o, rpage[o], PSTATE(pst[rpage[o]]),
            prd[rpage[o]], pgen[rpage[o]], rgen[o], RECHECK(o));
     if
     :: RECHECK(o)
     :: else ->
        if
        :: !bended[o] && paw[rpage[o]] == 0 ->
           printf("VIOLATION P7: r%d's healthy lease refused by the re-check (a false DATA_LOSS)\n", o)
        :: else
        fi;
        assert(bended[o] || paw[rpage[o]] != 0);
        revoked[o] = 1
     fi
  :: else
  fi
}
#endif

/* A revoked reader's page leaves quarantine lock_delay after the revocation, heard or not.
 * The stream is ordered (a sequence number per revocation, decode resumes from its cursor,
 * and re-validates its running leases after a gap): a notice still undelivered then means
 * decode has heard nothing since the revocation, lock_delay > the blind bound, so decode
 * has stopped every running request by then. Without the cursor a dropped notice is gone
 * while the stream (heartbeats) stays up: decode is not blind and does not stop. */
#ifdef MUT_NO_BLIND_STOP
#define BLIND_STOPS(o) 0
#else
#define BLIND_STOPS(o) (rvq[o] && !revoked[o] && !rdone[o])
#endif
/* With -DSTEP_WRITES (a step may still write its page after its check) a revoked reader's page
 * also waits for decode's acknowledgement: a KeepAlive of the pool that no longer lists the owner,
 * which decode sends once no step that may write the page can still run (the request ended, has
 * learnt of its revocation, or lost its allocation), lock_delay before the page is freed. Or the
 * pool's reader expired: then the pool is fenced for good and decode moves (restart(), which waits
 * for the step in flight: MOVE_OK). Without -DSTEP_WRITES a step is atomic and the acknowledgement
 * is not modelled (ACKED 1): the model has more behaviours than the code, and shows that the blind
 * stop and the cursor suffice there. */
#ifdef FOREIGN
#define FACK(o) fack[o]          /* another instance's KeepAlive, taken for decode's acknowledgement */
#else
#define FACK(o) 0
#endif
#if defined(STEP_WRITES) && !defined(MUT_NO_STEP_ACK)
#define ACKED(o) ((!stepping[o] && (rdone[o] || revoked[o] || unheld[o])) || FACK(o))
#else
#define ACKED(o) 1
#endif
/* FRENEW: another instance keeps renewing the holder of a revoked reader's, a failed write's or an
 * earlier epoch's pages, so the holder never expires (a renewal of a holder not its own, accepted) */
#define SWEEPABLE(p) (pst[p] == QUAR && \
        ((paw[p] >= 1 && paw[p] <= NWID && wdrained[paw[p]-1]) || (paw[p] == OLDW && olddrained && !FRENEW) \
         || (paw[p] == REVW && ACKED(powner[p]) && !FRENEW) || (paw[p] == FAILW && BOUND(powner[p]) && !FRENEW) \
         || paw[p] == BADW || (paw[p] == ADPW && olddrained && ACKED(powner[p]))))
/* sweep also ends writes of presumed-dead writers, and failed writes past the bound, on LEASED pages */
#define SWEEP_LEASED(p) (pst[p] == LEASED && \
        ((paw[p] >= 1 && paw[p] <= NWID && wdrained[paw[p]-1]) || (paw[p] == FAILW && BOUND(powner[p]) && !FRENEW) \
         || (paw[p] == ADPW && olddrained)))

/* ================================ processes ================================ */

/* the next request's forward pass on prefill process PROC(r) may take the source page of an
 * earlier write x of that process once SRCFREE(x): if x's write can still read it, x's
 * late write now carries r's KV */
inline SRCREUSE(r) {
  k = 0;
  do
  :: k < NR ->
     if
     :: k != r && PROC(k) == PROC(r) && SRCFREE(k) && PENDING(k) -> wsrc[k] = rstamp[r];
        printf("SOURCE    r%d's forward pass reuses the source page that r%d's write still reads\n", r, k)
     :: else
     fi;
     k++
  :: else -> break
  od;
  k = 0
}

proctype Writer(byte r) {                            /* prefill: servicer._prefill + worker.write */
  byte p;
  bit ok;
#ifdef MUT_ENDWRITE_GIVEUP
  bit sent;                                          /* attempts made: one (the code makes three) */
#endif
#ifdef MUT_NO_ENDWRITE_ON_BEGIN_FAILURE
  bit begun;                                         /* BeginWrite answered OK */
#endif
  {
    atomic {                                         /* BeginWrite */
      p = rpage[r];
      if
      :: BEGIN_OK(r) ->
         paw[p] = WID(r)+1; pawgen[p] = rgen[r]; pwrit[p] = 1; ok = 1;
#ifdef FAILOVER
         wterm[r] = failedover;
#endif
         if
         :: canpost[r] = 1;
#ifdef MUT_NO_ENDWRITE_ON_BEGIN_FAILURE
            begun = 1;
#endif
            printf("BEGIN     w%d for r%d on page %d g%d\n", WID(r), r, p, rgen[r])
         :: budget > 0 -> budget--; ok = 0;          /* fault: the reply is lost */
            printf("BEGIN     w%d for r%d on page %d g%d; FAULT reply lost\n", WID(r), r, p, rgen[r])
         fi
      :: OLD_BEGIN_OK(r) ->                          /* its prefill still talks to the old broker */
         oldcur[r] = 0; latebegin[r] = oldwdead; ok = 1; canpost[r] = 1;
#ifdef FAILOVER
         wterm[r] = 0;
#endif
#ifdef MUT_NO_ENDWRITE_ON_BEGIN_FAILURE
         begun = 1;
#endif
         printf("BEGIN     w%d for r%d on page %d g%d at the OLD broker (epoch %d)\n", WID(r), r, p, rgen[r], rep[r])
      :: else -> ok = 0;                             /* refused */
         printf("BEGIN     w%d for r%d refused\n", WID(r), r)
      fi;
      p = 0
    }
    /* forward pass; then the liveness check and the one-sided writes */
    if
    :: ok ->
       atomic {
         canpost[r] = 0;
         if
         :: WLIVE(r) ->
            /* the forward pass fills a source page: one whose earlier write can no longer
             * read it, or (mutant) any whose write call returned */
            SRCREUSE(r);
            wsrc[r] = rstamp[r];
            if
            :: pend_data[r] = 2; pend_tag[r] = 1; ptntok[r] = 2; wposted[r] = 1;
               printf("POST      r%d: data (2 tokens) and tag to page %d\n", r, rpage[r])
            :: budget > 0 -> budget--;               /* fault: short transfer reported done */
               pend_data[r] = 1; pend_tag[r] = 1; ptntok[r] = 1; wposted[r] = 1;
               printf("POST      r%d: FAULT short transfer, 1 token + tag num_tokens=1\n", r)
#ifndef NO_HOSTILE
            :: budget > 0 -> budget--;               /* fault: the request names another page */
#ifdef MUT_DEST_FROM_REQUEST
               wmis[r] = 1; pend_data[r] = 2; pend_tag[r] = 1; ptntok[r] = 2; wposted[r] = 1;
               printf("POST      r%d: FAULT request names page %d as destination; data goes there, tag to page %d\n",
                      r, (rpage[r] + 1) % NP, rpage[r])
#else
               ok = 0;                               /* addresses come from the pool's registration */
               printf("POST      r%d: FAULT request names page %d as destination; refused (not the pool's)\n",
                      r, (rpage[r] + 1) % NP)
#endif
#endif
            :: budget > 0 -> budget--;               /* fault: placeholder, nothing written, done */
               printf("POST      r%d: FAULT placeholder, nothing written, reports done\n", r)
            :: ok = 0;                               /* forward pass fails / prefill aborts */
               printf("POST      r%d: prefill aborts before writing\n", r)
            fi
         :: else -> ok = 0;                          /* own liveness lapsed: do not write */
            printf("POST      r%d: own liveness lapsed, writes nothing\n", r)
         fi
       };
       (!PENDING(r) || werr[r]);                     /* completion, or failure / timeout reported */
       if
       :: werr[r] -> ok = 0
       :: else
       fi
    :: else
    fi;
    /* EndWrite, always, also on failure; re-sent until the broker answers */
#ifdef MUT_NO_ENDWRITE_ON_BEGIN_FAILURE
    if
    :: begun
    :: else -> atomic { result[r] = FAILED; wfin[r] = 1; printf("PREFILL   r%d answers failed, no EndWrite\n", r) };
       goto wend
    fi;
#endif
    do
    :: ackdone[r] -> break
#ifdef MUT_ENDWRITE_GIVEUP
    :: atomic { !ackdone[r] && ackq[r] == 0 && !sent -> ackq[r]++; sent = 1; wok[r] = ok;
                printf("ENDWRITE  r%d sent (ok=%d)\n", r, ok) }
    :: atomic { !ackdone[r] && ackq[r] == 0 && sent -> printf("ENDWRITE  r%d: gives up\n", r); break }
#else
    :: atomic { !ackdone[r] && ackq[r] == 0 -> ackq[r]++; wok[r] = ok; printf("ENDWRITE  r%d sent (ok=%d)\n", r, ok) }
#endif
    od;
    atomic { result[r] = (ok -> DONE : FAILED); wfin[r] = 1; printf("PREFILL   r%d answers %e\n", r, PRESULT(result[r])) };
wend:
    skip
  } unless { atomic { wcrashed[PROC(r)] -> canpost[r] = 0; wfin[r] = 1 } }
}

/* decode stops listing r in its KeepAlive (its allocation dropped, nothing of r can step) */
#ifdef STEP_WRITES
#define UNHOLD(r) unheld[r] = 1
#else
#define UNHOLD(r) skip
#endif
/* with -DEXPIRY the allocation is in decode's table from the grant until Decode / Run takes it (or
 * expiry does); the reader's exits before the take give it back only if it is still there */
#ifdef EXPIRY
#define ALLOCATED(r) atab[r] = 1
#define PRE_OUT untaken
#else
#define ALLOCATED(r) skip
#define PRE_OUT out
#endif

/* a Grant is a miss (no cached page to share) */
#ifdef PREFIX
#define MISS(r) (HITP(r) == NONE)
#else
#define MISS(r) 1
#endif
/* P1: the bytes a step reads are its own lease's; a share's (-DPREFIX) are KV of its own content identity */
#ifdef PREFIX
#define OWN_BYTES(p,r) (rsh[r] -> (CONT(d0[p]) == cid[r] && CONT(d1[p]) == cid[r]) \
                        : (d0[p] == rstamp[r] && d1[p] == rstamp[r]))
#else
#define OWN_BYTES(p,r) (d0[p] == rstamp[r] && d1[p] == rstamp[r])
#endif

proctype Reader(byte r) {                            /* decode: Allocate, Decode, scheduler, Release */
  byte p;
  byte i;
#ifdef MUT_RELEASE_DURING_STEP
  bit pre;                                           /* preempted while its step ran */
#endif
#ifdef PREFIX
regrant:
#endif
  if
#ifdef PREFIX
  /* a hit: the Grant shares the cached page; decode checks it before it sends the destination (one step: the
   * Grant's reply and the check see one page, which nothing may write or evict while r is its reader) */
  :: atomic { !MISS(r) -> p = HITP(r); share(r, p);
              printf("VERIFY    r%d shared page %d: tag r%d/e%d/g%d chain %d num_tokens=%d, cells r%d/e%d/g%d r%d/e%d/g%d -> %d\n",
                     r, p, SHOW(tstamp[p]), TCHAIN(tstamp[p]), tntok[p], SHOW(d0[p]), SHOW(d1[p]), SHARED_OK(p, r));
              if
              :: SHARED_OK(p, r) -> p = 0; reading[r] = 1; wfin[r] = 1; goto steps  /* no write of this page */
              :: else -> p = 0; unpublish(r); rpage[r] = NONE; rsh[r] = 0;  /* a miss: the Grant again */
                 goto regrant
              fi }
#endif
  :: atomic { npst[FREE] >= NEED(r) && MISS(r) -> grant(r); ALLOCATED(r);
              if
              :: (ANYPATH >> r) & 1 ->
                 if
                 :: skip                             /* Allocate; Decode after prefill answered */
                 :: rrun[r] = 1
                 fi
              :: else -> rrun[r] = (RUNPATH >> r) & 1
              fi;
              printf("PATH      r%d: %d (1: Run, one stream, destination first; 0: Allocate, Decode)\n", r, rrun[r]) }
#ifdef LEASE_FAULTS
  :: atomic { npst[FREE] >= NEED(r) && MISS(r) && budget > 0 -> budget--; grant(r);   /* fault: the reply is lost */
              printf("GRANT     FAULT reply to r%d lost: decode never learns of page %d\n", r, rpage[r]);
              rdone[r] = 1; wfin[r] = 1; goto gone }
#endif
  :: atomic { rdone[r] = 1; wfin[r] = 1; goto gone } /* rejected or gave up before a grant */
  fi;
#ifdef FAILOVER
  if                                                 /* the Grant's reply reaches decode */
  :: atomic { !gold[r] -> gdel[r] = 1 }
  :: atomic { gold[r] ->                             /* decided by the old leader: its term is older than the one
                                                        decode handed its leases over to */
#ifdef MUT_FO_OLD_GRANT
              gdel[r] = 1; printf("GRANT     r%d takes the old leader's reply after the hand-over\n", r) }
#else
              rdone[r] = 1; wfin[r] = 1; printf("GRANT     r%d: the reply is of the old term, refused\n", r);
              goto gone }
#endif
  fi;
#endif
  if
  :: atomic { run Writer(r); printf("DISPATCH  r%d to prefill\n", r) }
  :: atomic { wfin[r] = 1; printf("CANCEL    r%d before dispatch\n", r); goto PRE_OUT }
  fi;
  if
  :: !rrun[r] && result[r] == DONE                    /* old path: prefill's answer */
  :: !rrun[r] && result[r] == FAILED -> goto PRE_OUT
  :: rrun[r] && RUN_READY(r)                          /* Run: the broker's write-done notice */
  :: atomic { printf("CANCEL    r%d while it waits (old path: for prefill; Run: for its notice)\n", r); goto PRE_OUT }
  fi;
  atomic {                                           /* verify_prompt_pages */
#if defined(FAILOVER) && !defined(MUT_FO_UNCLAIMED_READS)
    if
    :: unclaimed[r] -> printf("FAILOVER  r%d was left out of the claim: it ends before reading\n", r); goto PRE_OUT
    :: else
    fi;
#endif
#ifdef EXPIRY
    if                                               /* Decode / Run takes its allocation first */
    :: atab[r] -> atab[r] = 0; printf("TAKE      r%d: Decode / Run takes its allocation\n", r)
    :: else -> rdone[r] = 1;                         /* expiry took it: nothing to read or release */
       printf("TAKE      r%d: its allocation is gone (expiry took it): the request ends\n", r); goto gone
    fi;
#endif
    p = rpage[r];
    printf("VERIFY    r%d page %d: tag r%d/e%d/g%d num_tokens=%d, cells r%d/e%d/g%d r%d/e%d/g%d -> %d\n",
           r, p, SHOW(tstamp[p]), tntok[p], SHOW(d0[p]), SHOW(d1[p]), TAGOK(p, r) && COVERAGE(p) && CHECKSUM(p));
    if
    :: TAGOK(p, r) && COVERAGE(p) && CHECKSUM(p) -> p = 0
    :: else -> p = 0; goto out                       /* DATA_LOSS */
    fi;
    if                                               /* Run: the notice is the validation */
    :: rrun[r] ->
       printf("RUN       r%d: the notice's prompt digest is the Run's: %d\n", r, PROMPTOK(r));
       if
       :: PROMPTOK(r) -> reading[r] = 1; goto steps  /* no Validate */
       :: else -> goto out                           /* DATA_LOSS */
       fi
    :: else
    fi
  }
  atomic {                                           /* broker Validate */
    printf("VALIDATE  r%d -> %d\n", r, VALIDATE(r));
    if
    :: VALIDATE(r) -> reading[r] = 1
    :: else -> goto out
    fi
  }
steps:
#ifdef PREFIX
  atomic {                                           /* decode publishes the page it verified */
    if
    :: !rsh[r] -> publish(r)
    :: else
    fi
  };
#endif
#ifdef GROWTH
  if
  :: GROWER(r) -> goto gsteps
  :: else
  fi;
#endif
  do
  :: i < NSTEPS ->
     atomic {
       if
       :: GATE(r) ->
          /* P1: the step reads both cells of the prompt page */
          printf("STEP      r%d reads page %d: cells r%d/e%d/g%d r%d/e%d/g%d, own lease r%d/e%d/g%d\n",
                 r, rpage[r], SHOW(d0[rpage[r]]), SHOW(d1[rpage[r]]), SHOW(rstamp[r]));
          if
          :: !OWN_BYTES(rpage[r], r) ->
             printf("VIOLATION P1: r%d consumed bytes written under another lease (or of another content)\n", r)
          :: else
          fi;
          assert(OWN_BYTES(rpage[r], r));
          i++
#ifdef STEP_WRITES
          ; stepping[r] = 1                          /* the step thread runs on, maybe stalled */
#endif
       :: else -> printf("STEP      r%d: check fails, request ends\n", r); goto out
       fi
     };
#ifdef STEP_WRITES
     atomic {                                        /* ... and writes this token's KV into the page */
       d1[rpage[r]] = rstamp[r]; stepping[r] = 0;
       printf("STEPWRITE r%d's step writes its KV into page %d (now %e, last granted to r%d)\n",
              r, rpage[r], PSTATE(pst[rpage[r]]), powner[rpage[r]])
     }
#endif
  :: atomic { i < NSTEPS -> printf("CANCEL    r%d mid-stream\n", r); goto out }
  :: i == NSTEPS -> break
  od;
#ifdef GROWTH
  goto out;
gsteps:
  /* a growing request: its prompt page is full, so step i writes its token's K/V into cell i of the next
   * page, which decode leases by Extend ahead of need (Growth.plan, between steps: one call in flight) */
  do
  :: atomic { i < NGSTEPS && gpage[r] == NONE && bg[r] == NONE && !xsent[r] && xrep[r] == 0 -> xsent[r] = 1;
              printf("EXTEND    r%d: decode asks for a growth page\n", r) }
#ifdef MUT_GROWTH_BEFORE_LEASE
  :: atomic { xsent[r] && gpage[r] == NONE -> gpage[r] = (rpage[r] + 1) % NP; gstamp[r] = STAMP(r, rep[r], genctr + 1);
              printf("GROW      r%d takes page %d, the one it expects, as r%d/e%d/g%d before the Extend reply\n",
                     r, gpage[r], SHOW(gstamp[r])) }
#endif
  :: atomic { xrep[r] == XGRANTED -> xrep[r] = 0; gpage[r] = bg[r]; gstamp[r] = STAMP(r, rep[r], bggen[r]);
              printf("GROW      r%d applies the reply: growth page %d, lease r%d/e%d/g%d\n", r, gpage[r], SHOW(gstamp[r])) }
  :: atomic { xrep[r] == XDRY -> xrep[r] = 0 }          /* it asks again, waits, or is preempted (below) */
  :: atomic { xrep[r] == XREFUSED -> xrep[r] = 0;
              printf("GROW      r%d: growth refused, the request ends (GROWTH_REFUSED)\n", r); goto out }
  :: i < NGSTEPS && gpage[r] != NONE ->
     atomic {
       if                                            /* _stamp_own_pages: the tag of the page it starts */
       :: i == 0 && !revoked[r] && EPOK(r) -> tstamp[gpage[r]] = gstamp[r]; tntok[gpage[r]] = 0
       :: else
       fi;
       if
       :: GATE(r) && WORDS(tstamp[gpage[r]]) == gstamp[r] ->
          /* P1: it reads both prompt cells and the growth cells written before */
          printf("STEP      r%d reads page %d (r%d/e%d/g%d r%d/e%d/g%d) and growth page %d (r%d/e%d/g%d); writes its cell %d\n",
                 r, rpage[r], SHOW(d0[rpage[r]]), SHOW(d1[rpage[r]]), gpage[r], SHOW(d0[gpage[r]]), i);
          if
          :: d0[rpage[r]] != rstamp[r] || d1[rpage[r]] != rstamp[r] || (i == 1 && d0[gpage[r]] != gstamp[r]) ->
             printf("VIOLATION P1: r%d consumed bytes written under another lease\n", r)
          :: else
          fi;
          assert(d0[rpage[r]] == rstamp[r] && d1[rpage[r]] == rstamp[r] && (i == 0 || d0[gpage[r]] == gstamp[r]));
          stepping[r] = 2 + i; i++
       :: else -> printf("STEP      r%d: check fails, request ends\n", r); goto out
       fi
     };
#ifdef MUT_RELEASE_DURING_STEP
     if
     :: skip
     :: atomic { release(r); pre = 1;
                 printf("PREEMPT   r%d: preempted while its step runs, its Release goes out at once\n", r) }
     fi;
#endif
     atomic {                                        /* ... and writes this token's K/V into the growth page */
       if
       :: stepping[r] == 2 -> d0[gpage[r]] = gstamp[r]
       :: else -> d1[gpage[r]] = gstamp[r]
       fi;
       stepping[r] = 0;
       printf("STEPWRITE r%d's step writes its K/V into growth page %d (now %e, last granted to r%d)\n",
              r, gpage[r], PSTATE(pst[gpage[r]]), powner[gpage[r]])
     }
#ifdef MUT_RELEASE_DURING_STEP
     ; if :: pre -> goto out :: else fi
#endif
  :: atomic { i < NGSTEPS -> printf("CANCEL    r%d mid-stream (a client; or PREEMPTED: the pool ran dry)\n", r); goto out }
  :: i == NGSTEPS -> break
  od;
#endif
out:
  atomic {
    reading[r] = 0; i = 0;
#ifdef GROWTH
    gpage[r] = NONE; gstamp[r] = 0;                  /* what decode knew of its growth lease */
#endif
    if
    :: release(r)
#ifdef LEASE_FAULTS
    :: budget > 0 && HOLDS(r) -> budget--;           /* fault: Release fails, decode moves on */
       printf("RELEASE   FAULT r%d's Release fails; the lease stays\n", r)
#endif
    fi;
    rdone[r] = 1
  };
#ifdef EXPIRY
  goto gone;
untaken:                                             /* Decode.Release, or the Run ends before its take */
  atomic {
    if
    :: atab[r] -> atab[r] = 0; release(r)
    :: else                                          /* expiry took it and released it */
    fi;
    rdone[r] = 1
  };
#endif
gone:
  skip
}

#define DST(r) ((rpage[r] + wmis[r]) % NP)    /* where the data write goes */
#define NETR(r) \
  :: atomic { pend_data[r] > 0 -> \
              printf("LAND      data of r%d on page %d: r%d/e%d/g%d\n", r, DST(r), SHOW(wsrc[r])); \
              if :: wsrc[r] != rstamp[r] -> \
                    printf("VIOLATION P6: a write under r%d's lease carries bytes of r%d/e%d/g%d\n", r, SHOW(wsrc[r])) \
                 :: else fi; \
              assert(wsrc[r] == rstamp[r]); \
              d0[DST(r)] = wsrc[r]; \
              if :: pend_data[r] == 2 -> d1[DST(r)] = wsrc[r] :: else fi; pend_data[r] = 0 } \
  :: atomic { pend_tag[r] -> tstamp[rpage[r]] = rstamp[r]; tntok[rpage[r]] = ptntok[r]; pend_tag[r] = 0; \
              printf("LAND      tag of r%d on page %d\n", r, rpage[r]) } \
  :: atomic { PENDING(r) && !werr[r] && budget > 0 -> budget--; werr[r] = 1; \
              printf("NET       FAULT transfer of r%d reports failure / times out; posted writes may still land\n", r) } \
  :: atomic { pend_data[r] > 0 && budget > 0 -> budget--; pend_data[r] = 0; \
              printf("NET       FAULT data write of r%d silently lost\n", r) } \
  :: atomic { ackq[r] > 0 -> ackq[r]--; end_write(r) } \
  :: atomic { ackq[r] > 0 && budget > 0 -> budget--; ackq[r]--; printf("NET       FAULT EndWrite of r%d lost\n", r) } \
  :: atomic { ackq[r] > 0 && budget > 0 -> budget--; ackq[r]++; printf("NET       FAULT EndWrite of r%d duplicated\n", r) } \
  :: atomic { rvq[r] && AFTER_NOTICE(r) -> rvq[r] = 0; \
              if :: DROPPED(r) -> UNHOLD(r); \
                    printf("NOTICE    r%d's revocation reaches a Run that does not read yet: decode drops it\n", r) \
                 :: else -> revoked[r] = 1; printf("NOTICE    r%d learns of its revocation\n", r); NOTICE_RELEASE(r) fi } \
  :: atomic { wdq[r] && !(rvq[r] && wdlate[r]) -> wdq[r] = 0; wdd[r] = 1; \
              printf("NOTICE    r%d's write-done notice reaches decode\n", r) } \
  NODROP(r)
/* decode's revocation handler ends the request (Scheduler._end) and sends its Release at once, while a step
 * of it may still run: harmless while a revoked owner holds nothing, so it is modelled only where an owner
 * could hold a lease the revocation did not end (a growth page) */
#ifdef GROWTH
#define NOTICE_RELEASE(r) release(r)
#else
#define NOTICE_RELEASE(r) skip
#endif
#ifdef MUT_NO_CURSOR
/* no cursor: a notice the stream drops is never sent again; the stream itself stays up */
#define NODROP(r) \
  :: atomic { rvq[r] -> rvq[r] = 0; printf("NET       the stream drops r%d's revocation notice; no cursor, never re-sent\n", r) }
#else
#define NODROP(r)  /* with the cursor a dropped notice is replayed on resubscribe: a delay */
#endif
/* in order: data lands, tag lands, transfer error or timeout reported (fault; its writes
 * stay in flight), silent loss (fault),
 * EndWrite delivered, EndWrite lost (fault), EndWrite duplicated (fault),
 * revocation notice delivered (late: the stream delays, disconnects, resumes; after a write-done
 * notice of r logged before it), write-done notice delivered (likewise ordered). A revocation
 * reaching a Run that has no notice yet may be dropped by decode: the model drops it (the worst
 * case; the Run can be cancelled at any time) */

#ifdef PREFIX
/* the revocation stream reconnects (a reset, a proxy, the broker's cut): decode re-checks what runs; or it reports
 * a gap: a revocation notice of a running request is lost for good (the log moved past it), and the re-check alone
 * must find it. Without the re-check decode would read on after its share ended. */
#define OUTAGES \
  :: atomic { !reconnected -> reconnected = 1; printf("NET       decode's revocation stream reconnects\n"); \
              recheck(0); recheck(1) } \
  :: atomic { !gapped && rvq[0] && reading[0] -> gapped = 1; rvq[0] = 0; \
              printf("NET       the stream reports a gap: r0's revocation notice is lost\n"); recheck(0); recheck(1) } \
  :: atomic { !gapped && rvq[1] && reading[1] -> gapped = 1; rvq[1] = 0; \
              printf("NET       the stream reports a gap: r1's revocation notice is lost\n"); recheck(0); recheck(1) }
#else
#define OUTAGES
#endif

proctype Net() {
  byte p;
end:
  do
  NETR(0)
  NETR(1)
#if NR > 2
  NETR(2)
#endif
  OUTAGES
  od
}

/* -DREVOKE_FAULTS=n: n revocations on top of the fault budget (a run with -DFAULTS=0 that explores revocations
 * alone, where the full budget's state space is too large for the default check) */
#ifdef REVOKE_FAULTS
byte rbudget = REVOKE_FAULTS;
#define RBUDGET rbudget
#else
#define RBUDGET budget
#endif
#define REVOKE(r) \
  :: atomic { RBUDGET > 0 && HOLDS(r) -> RBUDGET--; revoke(r); \
              printf("REVOKE    r%d's lease: page %d is now %e\n", r, rpage[r], PSTATE(pst[rpage[r]])) }

#define CRASH(w) \
  :: atomic { budget > 0 && !wcrashed[w] -> budget--; wcrashed[w] = 1; \
              printf("CRASH     FAULT prefill process %d crashes\n", w) }
#ifdef WRITER_PER_WRITE
#define ENDED(x) wfin[x]         /* the write ended: its lease is no longer renewed */
#else
#define ENDED(x) 0               /* a process-wide lease is renewed while the process lives */
#endif
#define LIVENESS(x) \
  :: atomic { budget > 0 && !wexp[x] && !wcrashed[WPROC(x)] -> budget--; wexp[x] = 1; \
              printf("EXPIRE    FAULT writer w%d's liveness lapses while it runs\n", x) } \
  :: atomic { (wexp[x] || wcrashed[WPROC(x)] || ENDED(x)) && !wdrained[x] -> drain(x) }
/* a process crashes (fault); a writer's liveness lapses while it runs (fault: partition,
 * stall, a write past its timeout; it then posts nothing more); expiry + lock_delay passes
 * (for a crashed or finished writer the expiry itself is invisible) */

/* a lease adopted at a failover and then revoked by the new leader keeps its adopted mark (the old term's
 * writes) and takes the revocation's rule too: its sweep is one step with the blind stop */
#ifdef MUT_FO_ADOPTED_REVOKE_UNBLIND
#define ADOPTED_REVOKED(p) 0
#else
#define ADOPTED_REVOKED(p) (paw[p] == ADPW)
#endif
#define SWEEP(p) \
  :: atomic { SWEEPABLE(p) -> \
              if :: (paw[p] == REVW || ADOPTED_REVOKED(p)) && BLIND_STOPS(powner[p]) -> blind_stop() :: else fi; \
              paw[p] = 0; setpst(p, FREE); printf("SWEEP     page %d leaves quarantine\n", p) } \
  :: atomic { SWEEP_LEASED(p) -> paw[p] = 0; printf("SWEEP     page %d: dead writer cleared\n", p) }

/* lease expiry. KeepAlive of decode lists the owners it holds: the broker revokes, through
 * quarantine, a lease its holder no longer holds (a Grant whose reply was lost, a Release that
 * failed): held = the reader has not finished. A reconciliation that hits a lease still held
 * (a KeepAlive racing a Grant) is a revocation, which REVOKE covers. */
#if defined(MUT_NO_LEASE_EXPIRY)
#define RECONCILE(r)
#define POOL_EXPIRY
#elif !defined(LEASE_FAULTS)
#define RECONCILE(r)   /* enabled only after a lost Grant reply or a failed Release */
#define POOL_EXPIRY
#else
#ifdef GROWTH
/* by owner, growth page included (one left by a lost Extend reply, say) */
#define RECONCILE(r) \
  :: atomic { rdone[r] && HOLDS(r) -> \
              if :: BG_CUR(r) -> if :: paw[bg[r]] == 0 -> paw[bg[r]] = REVW :: else fi; end_lease(bg[r]) :: else fi; \
              if :: LEASE_CUR(r) -> if :: paw[rpage[r]] == 0 -> paw[rpage[r]] = REVW :: else fi; end_lease(rpage[r]) \
                 :: else fi; \
              printf("EXPIRE    r%d's leases are no longer held by decode: revoked through quarantine\n", r) }
#else
#define RECONCILE(r) \
  :: atomic { rdone[r] && LEASE_CUR(r) -> \
              if :: paw[rpage[r]] == 0 -> paw[rpage[r]] = REVW :: else fi; end_lease(rpage[r]); \
              printf("EXPIRE    r%d's lease is no longer held by decode: page %d is now %e\n", r, rpage[r], PSTATE(pst[rpage[r]])) }
#endif
/* decode stopped renewing the pool (partition, stall, crash): every lease of it is revoked */
#define POOL_EXPIRY \
  :: atomic { budget > 0 && (HOLDS(0) || HOLDS(1)) -> budget--; \
              printf("EXPIRE    FAULT decode stops renewing the pool: every lease revoked\n"); \
              if :: HOLDS(0) -> revoke(0) :: else fi; \
              if :: HOLDS(1) -> revoke(1) :: else fi }
#endif

/* a second Prefill of r's lease (retry, replay, bug) with another prompt: BeginWrite, both
 * writes and EndWrite in one step (its own late landings are the Writer's case) */
#ifdef NO_HOSTILE
#define REPLAY(r)
#else
#define REPLAY(r) \
  :: atomic { budget > 0 && BEGIN_OK(r) -> budget--; pwrit[rpage[r]] = 1; \
              d0[rpage[r]] = rstamp[r] + OTHER; d1[rpage[r]] = rstamp[r] + OTHER; \
              tstamp[rpage[r]] = rstamp[r] + OTHER; tntok[rpage[r]] = 2; \
              if :: rrun[r] -> notice(r, 1) :: else fi; \
              printf("REPLAY    FAULT a second Prefill of r%d's lease writes another prompt's KV to page %d\n", r, rpage[r]) }
#endif

#ifdef PREFIX
/* eviction of an unread cached page (LRU when a Grant or Extend finds the pool short: here any unread one, at
 * any time a Grant waits for a page, which has every behaviour of the code's choice) */
#define WAITG(r) (rpage[r] == NONE && !rdone[r])
#define EVICT(p) \
  :: atomic { pst[p] == CACHED && pidx[p] && EVICTABLE(p) && (WAITG(0) || WAITG(1)) -> \
              pidx[p] = 0; prd[p] = 0; prv[p] = 0; setpst(p, FREE); printf("EVICT     cached page %d\n", p) }
/* a cached page changes in place while unread (a stray write, a bit flip; fault): bytes or tag */
#define CORRUPT(p) \
  :: atomic { budget > 0 && pst[p] == CACHED && prd[p] == 0 && prv[p] == 0 -> budget--; \
              if :: d1[p] = 0 :: tstamp[p] = 0 fi; \
              printf("CORRUPT   FAULT cached page %d changes in place: cells r%d/e%d/g%d tag r%d/e%d/g%d\n", \
                     p, SHOW(d1[p]), SHOW(tstamp[p])) }
/* a revoked reader's share ends lock_delay after the revocation, heard or not (as REVW's quarantine) */
#define SWEEPSH(p, o) \
  :: atomic { ((prv[p] >> (o)) & 1) && ACKED(o) -> \
              if :: BLIND_STOPS(o) -> blind_stop() :: else fi; \
              prv[p] = prv[p] & ~(1 << (o)); unread(p); printf("SWEEP     r%d's revoked share of page %d ends\n", o, p) }
/* a BeginWrite naming a shared page's lease (a second Prefill, a bug), writing another prompt's KV: a cached
 * page is sealed, so the broker refuses it (no transition); the mutant accepts it */
#ifdef MUT_WRITE_INTO_SHARED
#define REPLAYS(r) \
  :: atomic { budget > 0 && SHARE_CUR(r) -> budget--; \
              d0[rpage[r]] = pck[rpage[r]] + OTHER; d1[rpage[r]] = pck[rpage[r]] + OTHER; \
              tstamp[rpage[r]] = pck[rpage[r]] + OTHER; tntok[rpage[r]] = 2; \
              printf("REPLAY    FAULT a Prefill naming r%d's shared lease writes another prompt's KV to cached page %d\n", \
                     r, rpage[r]) }
#else
#define REPLAYS(r)
#endif
#else
#define EVICT(p)
#define CORRUPT(p)
#define SWEEPSH(p, o)
#define REPLAYS(r)
#endif

#ifdef GROWTH
/* the broker takes r's item of an Extend call, at any time after decode sent it (after a Revoke, a Release,
 * a restart that came meanwhile: the races of issue 19); its reply may be lost (fault: decode never learns of
 * the page, which the owner's Release or reconciliation still ends) */
#define EXTEND(r) \
  :: atomic { xsent[r] -> extend(r) } \
  :: atomic { xsent[r] && budget > 0 -> budget--; extend(r); xrep[r] = 0; \
              printf("EXTEND    FAULT the reply to r%d is lost\n", r) }
/* a second Prefill naming r's growth lease (BeginWrite on it, another prompt's KV, EndWrite): refused while
 * growth pages are sealed */
#ifdef NO_HOSTILE
#define REPLAYG(r)
#else
#define REPLAYG(r) \
  :: atomic { budget > 0 && BG_CUR(r) && paw[bg[r]] == 0 && !pwrit[bg[r]] -> budget--; pwrit[bg[r]] = 1; \
              d0[bg[r]] = STAMP(r, rep[r], bggen[r]) + OTHER; d1[bg[r]] = STAMP(r, rep[r], bggen[r]) + OTHER; \
              tstamp[bg[r]] = STAMP(r, rep[r], bggen[r]) + OTHER; tntok[bg[r]] = 2; \
              printf("REPLAY    FAULT a Prefill naming r%d's growth lease writes another prompt's KV to page %d\n", r, bg[r]) }
#endif
#else
#define EXTEND(r)
#define REPLAYG(r)
#endif

/* decode's move to a new broker incarnation (restart()) registers the new pool only once its step in
 * flight has ended: a step stalled past the fence would write a page the new incarnation has granted */
#if defined(STEP_WRITES) && !defined(MUT_MOVE_DURING_STEP)
#if NR > 2
#define MOVE_OK (!stepping[0] && !stepping[1] && !stepping[2])
#else
#define MOVE_OK (!stepping[0] && !stepping[1])
#endif
#else
#define MOVE_OK 1
#endif

proctype Broker() {                           /* restart, revoke, liveness, sweeper */
  byte p;
end:
  do
#ifdef FAILOVER
  :: atomic { !failedover -> failover() }            /* the event under study: no fault budget */
  :: atomic { failedover && oldwdead && !olddrained -> olddrain() }
#if defined(MUT_FO_AUTH_PAST_LEASE) || defined(MUT_FO_BEGIN_IGNORES_TERM)
  /* prefill sees the new term (an answer of the new leader): only where the old leader may still answer after
   * the failover does it change anything (A8 rules that out), so the other runs leave it out */
  :: atomic { failedover && !nseen[0] -> nseen[0] = 1; printf("TERM      prefill 0 sees term 1\n") }
#if NW > 1
  :: atomic { failedover && !nseen[1] -> nseen[1] = 1; printf("TERM      prefill 1 sees term 1\n") }
#endif
#endif
#else
  :: atomic { budget > 0 && !restarted && MOVE_OK -> budget--; restart() }
#endif
  :: atomic { restarted && !oldfenced -> oldfenced = 1;
              printf("FENCE     old broker: the pool's reader expired; it refuses BeginWrite and renewals\n") }
  :: atomic { oldfenced && !oldwdead -> oldwdead = 1;
              printf("LAPSE     every writer the old broker renewed: liveness expired\n") }
  :: atomic { restarted && !olddrained && FENCE_WAITED -> olddrain() }
  REVOKE(0)
  REVOKE(1)
#if NR > 2
  REVOKE(2)
#endif
  RECONCILE(0)
  RECONCILE(1)
#if NR > 2
  RECONCILE(2)
#endif
  POOL_EXPIRY
  REPLAY(0)
  REPLAY(1)
  EXTEND(0)
  EXTEND(1)
#if NR > 2
  EXTEND(2)
#endif
  REPLAYG(0)
  REPLAYG(1)
  REPLAYS(0)
  REPLAYS(1)
  EVICT(0)
  EVICT(1)
#if NP > 2
  EVICT(2)
#endif
  CORRUPT(0)
  CORRUPT(1)
  SWEEPSH(0, 0)
  SWEEPSH(0, 1)
  SWEEPSH(1, 0)
  SWEEPSH(1, 1)
  CRASH(0)
#if NW > 1
  CRASH(1)
#endif
  LIVENESS(0)
#if NWID > 1
  LIVENESS(1)
#endif
#if NWID > 2
  LIVENESS(2)
#endif
  SWEEP(0)
  SWEEP(1)
#if NP > 2
  SWEEP(2)
#endif
  od
}

#ifdef EXPIRY
/* decode's allocation expiry (expire_allocations; the drain's release of what never got its Decode call
 * is the same), at any time while an allocation is granted and not taken: it pops the allocation
 * before any await, then releases what it popped. The reader's take and expiry's pop each hand the
 * allocation out once, so the Release never hits a request that decodes. Pop and Release are one step
 * here: the popped allocation is nobody's, and its Release arriving later is the release of a lease
 * that nothing reads, which the reader's own cancellation explores at every point. */
#ifdef MUT_EXPIRY_SNAPSHOT
/* before the fix: expiry iterates over a snapshot of the table; after awaiting an earlier Release it
 * pops r (None if Decode / Run took it meanwhile) and releases the snapshot's leases anyway */
#define EXPIRE(r) \
  :: atomic { ((EXPIRING >> r) & 1) && atab[r] && !esnap[r] -> esnap[r] = 1; \
              printf("EXPIRE    r%d's allocation is in expiry's snapshot of the table\n", r) } \
  :: atomic { esnap[r] -> esnap[r] = 0; \
              atab[r] = 0; \
              printf("EXPIRE    r%d: expiry releases the snapshot's leases, taken or not\n", r); release(r) }
#else
#define EXPIRE(r) \
  :: atomic { ((EXPIRING >> r) & 1) && atab[r] -> atab[r] = 0; UNHOLD(r); \
              printf("EXPIRE    r%d's allocation: deadline passed, expiry takes it and releases it\n", r); release(r) }
#endif
#ifndef EXPIRING
#define EXPIRING 3     /* bit r: r's allocation may expire */
#endif
proctype Expiry() {
end:
  do
  EXPIRE(0)
  EXPIRE(1)
#if NR > 2
  EXPIRE(2)
#endif
  od
}
#endif

#ifdef FOREIGN
/* A second decode instance calls the broker for this decode's pool (pool ids are metric labels). With
 * instance identity the broker refuses every such call, which changes nothing: no transition. The mutant
 * authorises by role (one certificate per role): bit 0 Release of an owner, 1 a reader KeepAlive that
 * lists no owner (NOT_HELD for every lease past the grace, and decode's acknowledgement), 2 renewals of
 * the holders revoked/, failed/, earlier-epoch/ of this pool, 3 renewals of the old incarnation's reader
 * record after decode moved. An adversary, not a fault: its calls cost no budget (each guard lets a
 * call happen once per lease, or once). */
#ifndef MUT_ROLE_AUTHZ
#define MUT_ROLE_AUTHZ 0
#endif
#define BY_ROLE(c) ((MUT_ROLE_AUTHZ >> (c)) & 1)
#define FOREIGN_RELEASE(r) \
  :: atomic { BY_ROLE(0) && HOLDS(r) -> \
              printf("FOREIGN   another decode instance releases r%d in this decode's pool: accepted\n", r); \
              release(r) }
proctype Foreign() {
end:
  do
  FOREIGN_RELEASE(0)
  FOREIGN_RELEASE(1)
  :: atomic { BY_ROLE(1) && (HOLDS(0) || HOLDS(1)) ->
              printf("FOREIGN   another decode instance's KeepAlive for this pool lists no owner: NOT_HELD, acknowledged\n");
              if :: HOLDS(0) -> revoke(0); fack[0] = 1 :: else fi;
              if :: HOLDS(1) -> revoke(1); fack[1] = 1 :: else fi }
  :: atomic { BY_ROLE(2) && !frenew -> frenew = 1;
              printf("FOREIGN   another decode instance keeps renewing the holders revoked/, failed/, earlier-epoch/ of this pool\n") }
  :: atomic { BY_ROLE(3) && restarted && !oldfenced && !foldpool -> foldpool = 1;
              printf("FOREIGN   another decode instance keeps renewing this decode's old pool at the old broker\n") }
  od
}
#endif

/* P2 and P3, checked in every reachable state */
#if NP > 2
#define COUNT(s) ((pst[0] == s) + (pst[1] == s) + (pst[2] == s))
#else
#define COUNT(s) ((pst[0] == s) + (pst[1] == s))
#endif
#if NR > 2
#define ONE_LIVE (!TWO_LIVE(0,1) && !TWO_LIVE(0,2) && !TWO_LIVE(1,2))
#else
#define ONE_LIVE (!TWO_LIVE(0,1))
#endif
/* P4: a FREE page (grantable) has no writer that can still land a write on it (decode's step included) */
#if defined(GROWTH)
#define STEPPING(r) (stepping[r] == 1)               /* a step that writes the prompt page */
#elif defined(STEP_WRITES)
#define STEPPING(r) stepping[r]
#else
#define STEPPING(r) 0
#endif
#ifdef GROWTH
#define FREE_WRITING(r) ((rpage[r] != NONE && pst[rpage[r]] == FREE && (INFLIGHT(r) || STEPPING(r))) \
                         || (stepping[r] >= 2 && pst[gpage[r]] == FREE))
/* P1 over a step that is not atomic: the cells it reads carry the reader's stamp until it ends (a growth
 * step reads the prompt cells, and the second also the first's growth cell) */
#define STEP_OWN(r) (!stepping[r] || (d0[rpage[r]] == rstamp[r] && d1[rpage[r]] == rstamp[r] \
                     && (stepping[r] != 3 || d0[gpage[r]] == gstamp[r])))
#else
#define FREE_WRITING(r) (rpage[r] != NONE && pst[rpage[r]] == FREE && (INFLIGHT(r) || STEPPING(r)))
/* P1 over a step that is not atomic: the cells it reads carry the reader's stamp until it ends */
#define STEP_OWN(r) (!STEPPING(r) || (d0[rpage[r]] == rstamp[r] && d1[rpage[r]] == rstamp[r]))
#endif
#if NR > 2
#define STEPS_OWN (STEP_OWN(0) && STEP_OWN(1) && STEP_OWN(2))
#else
#define STEPS_OWN (STEP_OWN(0) && STEP_OWN(1))
#endif
#if NR > 2
#define DRAINED_WRITERS (!FREE_WRITING(0) && !FREE_WRITING(1) && !FREE_WRITING(2))
#else
#define DRAINED_WRITERS (!FREE_WRITING(0) && !FREE_WRITING(1))
#endif
#ifdef PREFIX
#define NO_PAGE_LOST (npst[FREE] + npst[LEASED] + npst[QUAR] + npst[CACHED] == NP && npst[FREE] == COUNT(FREE) \
                      && npst[LEASED] == COUNT(LEASED) && npst[QUAR] == COUNT(QUAR) && npst[CACHED] == COUNT(CACHED))
#else
#define NO_PAGE_LOST (npst[FREE] + npst[LEASED] + npst[QUAR] == NP && npst[FREE] == COUNT(FREE) \
                      && npst[LEASED] == COUNT(LEASED) && npst[QUAR] == COUNT(QUAR))
#endif

#ifdef PREFIX
/* P2 with shared pages: a live reader's page is never FREE (anyone's next Grant may take it) */
#define HELD(r) (!LIVE_R(r) || pst[rpage[r]] != FREE)
#define ALL_HELD (HELD(0) && HELD(1))
#else
#define ALL_HELD 1
#endif
proctype Monitor() {
end:
  if
  :: atomic { !ONE_LIVE -> printf("VIOLATION P2: two live readers on one page\n"); assert(false) }
  :: atomic { !ALL_HELD -> printf("VIOLATION P2: a live reader's page is FREE\n"); assert(false) }
  :: atomic { !NO_PAGE_LOST -> printf("VIOLATION P3: page counts do not add up\n"); assert(false) }
  :: atomic { !DRAINED_WRITERS ->
              printf("VIOLATION P4: a page is FREE while a writer can still land bytes on it\n"); assert(false) }
  :: atomic { !STEPS_OWN ->
              printf("VIOLATION P1: a step in flight reads bytes written under another lease\n"); assert(false) }
  fi
}

/* P5 (safety form): no terminal state leaves a page leased or quarantined.
 * No end label: a terminal state before this completes is an "invalid end state". */
#if NR > 2
#define ALLDONE (rdone[0] && rdone[1] && rdone[2] && wfin[0] && wfin[1] && wfin[2])
#else
#define ALLDONE (rdone[0] && rdone[1] && wfin[0] && wfin[1])
#endif
proctype Drained() {
#ifdef PREFIX
  /* a cached page stays cached, unread (evictable), when everything is done */
  (ALLDONE && npst[LEASED] == 0 && npst[QUAR] == 0 && (prd[0] | prv[0] | prd[1] | prv[1]) == 0)
#else
  (ALLDONE && npst[FREE] == NP)
#endif
}

init {
  atomic {
    k = 0;
    do
    :: k < NP -> tntok[k] = 2; k++                      /* a previous tenant's full page */
    :: else -> break
    od;
    k = 0;
    do
    :: k < NR -> rpage[k] = NONE;
#ifdef GROWTH
       gpage[k] = NONE; bg[k] = NONE;
#endif
       k++
    :: else -> break
    od;
    k = 0;
    npst[FREE] = NP;
#ifdef PREFIX
    cid[0] = 0;
#if R1ID == 3
    if :: cid[1] = 0 :: cid[1] = 1 :: cid[1] = 2 fi;
#else
    cid[1] = R1ID;
#endif
#endif
    run Net(); run Broker(); run Monitor(); run Drained();
#ifdef EXPIRY
    run Expiry();
#endif
#ifdef FOREIGN
    run Foreign();
#endif
    run Reader(0); run Reader(1);
#if NR > 2
    run Reader(2)
#endif
  }
}

#ifndef NOLTL
#if NP > 2
ltl drains { [] (pst[0] == QUAR -> <> (pst[0] == FREE)) && [] (pst[1] == QUAR -> <> (pst[1] == FREE))
             && [] (pst[2] == QUAR -> <> (pst[2] == FREE)) }
#else
ltl drains { [] (pst[0] == QUAR -> <> (pst[0] == FREE)) && [] (pst[1] == QUAR -> <> (pst[1] == FREE)) }
#endif
#endif

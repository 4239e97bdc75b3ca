#!/usr/bin/env bash
# Model-checks the lease and transfer protocol (formal/pdserve.pml) and every mutant.
#
#   bash formal/check.sh            (from anywhere; `make formal` runs it)
#
# Passes only when every run of the model (and of each formal/redundant/*.pml) reports
# `errors: 0` after an exhaustive search, and every formal/mutants/*.pml reports at least one
# error; for each mutant it prints the counter-example as a short trace. The verifier exits 0
# even when it finds errors, so its output is parsed.
#
# Environment: FORMAL_OUT (build directory, default formal/out), FORMAL_JOBS (parallel runs,
# default: number of CPUs), FORMAL_DEEP=1 (also the model with a fault budget of 2, the LTL
# runs with the lease faults and with the non-atomic step, every request free to choose its
# decode path, allocation expiry with the fault budget, the non-atomic step with the lease
# faults and with both requests on Run, growth with three pages and with the lease faults, prefix
# reuse with every content identity and the fault budget, failover with revocations, with P5's formula and with the
# fault budget (with the non-atomic step, with both requests on Run), and redundant/*_deep.pml; minutes, GiBs),
# CC (default gcc).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${FORMAL_OUT:-$here/out}
jobs=${FORMAL_JOBS:-$(nproc 2>/dev/null || echo 2)}
cc=${CC:-gcc}
t0=$(date +%s)

for tool in spin "$cc"; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "formal: '$tool' not found; install the Debian packages spin and gcc (make formal does)" >&2
    exit 2
  fi
done

rm -rf "$out"
mkdir -p "$out"

# one verification: name kind model spin-defines cc-flags pan-args
#   kind: model (must report errors: 0) or mutant (must report errors > 0)
run_one() {
  local name=$1 kind=$2 pml=$3 defs=$4 cflags=$5 args=$6
  local d=$out/$name
  mkdir -p "$d"
  (
    cd "$d" || exit 1
    # shellcheck disable=SC2086
    if ! spin $defs -a "$pml" >spin.log 2>&1; then
      echo "status=spin-failed" >result; exit 0
    fi
    # shellcheck disable=SC2086
    if ! "$cc" $cflags -w -o pan pan.c >cc.log 2>&1; then
      echo "status=cc-failed" >result; exit 0
    fi
    local s e
    s=$(date +%s.%N)
    # shellcheck disable=SC2086
    ./pan $args >pan.log 2>&1
    e=$(date +%s.%N)
    {
      echo "errors=$(grep -oE 'errors: [0-9]+' pan.log | tail -1 | awk '{print $2}')"
      echo "states=$(awk '/states, stored/ {print $1}' pan.log | tail -1)"
      echo "transitions=$(awk '/transitions \(= / {print $1}' pan.log | tail -1)"
      echo "depth=$(grep -oE 'depth reached [0-9]+' pan.log | tail -1 | awk '{print $3}')"
      echo "secs=$(awk -v s="$s" -v e="$e" 'BEGIN {printf "%.1f", e - s}')"
      if grep -qE 'max search depth too small|out of memory|search not completed' pan.log; then
        echo "status=incomplete"
      else
        echo "status=done"
      fi
    } >result
    if [ "$kind" = mutant ]; then
      local trail
      trail=$(ls ./*.trail 2>/dev/null | head -1)
      if [ -n "$trail" ]; then
        {
          grep -m1 -E '^pan:[0-9]+:' pan.log | grep -v 'assertion violated' | cut -c1-120
          # shellcheck disable=SC2086
          spin $defs -t -k "$trail" "$pml" 2>&1 |
            grep -E '^[[:space:]]*[A-Z]{3,} |^spin: .*(Error|assertion|trail ends)' |
            sed -E 's/^[[:space:]]+//; s#^spin: [^ ]*/#spin: #'
        } >trace.txt
      fi
    fi
  )
}

specs=()
add() { specs+=("$1|$2|$3|$4|$5|$6"); }

# -O1: pan.c compiles in a third of -O2's time and runs about as fast
safety="-O1 -DSAFETY -DNOCLAIM"
add model-default            model "$here/pdserve.pml" ""                   "$safety" "-m10000"
add model-writer-per-write   model "$here/pdserve.pml" "-DWRITER_PER_WRITE" "$safety" "-m10000"
add model-two-prefills       model "$here/pdserve.pml" "-DNW=2"             "$safety" "-m10000"
add model-three-pages        model "$here/pdserve.pml" "-DNP=3"             "$safety" "-m10000"
add model-lease-faults      model "$here/pdserve.pml" "-DLEASE_FAULTS"     "$safety" "-m10000"
# the other runs put r0 on Decode.Run and r1 on the old path (Allocate, Decode); here both use Run
add model-both-run           model "$here/pdserve.pml" "-DRUNPATH=3"        "$safety" "-m10000"
add model-ltl-drains         model "$here/pdserve.pml" ""                   "-O1"     "-m10000 -a -N drains"
# issue 18: a decode step that checks, then writes its page later, with the acknowledgement rule
add model-step-writes        model "$here/pdserve.pml" "-DSTEP_WRITES"      "$safety" "-m10000"
# issue 18: allocation expiry as its own process, racing both requests' takes in honest operation
# (the race needs no fault; with the fault budget: FORMAL_DEEP=1)
add model-expiry             model "$here/pdserve.pml" "-DEXPIRY -DFAULTS=0" "$safety" "-m10000"
# issue 19, pages on demand: both requests grow by Extend into a page decode writes (the non-atomic step
# included); and a Grant with a headroom page (r0), sealed like a growth page
add model-growth             model "$here/pdserve.pml" "-DGROWTH -DGROWS=3" "$safety" "-m10000"
add model-growth-headroom    model "$here/pdserve.pml" "-DHEADROOM"         "$safety" "-m10000"
# issue 20, prefix reuse: r1 of r0's content shares r0's cached page, with the fault budget; and r1 of every
# content identity (r0's, another scope, the same tokens at another offset) in honest operation
add model-prefix             model "$here/pdserve.pml" "-DPREFIX -DR1ID=0"  "$safety" "-m10000"
add model-prefix-contents    model "$here/pdserve.pml" "-DPREFIX -DFAULTS=0" "$safety" "-m10000"
# issue 29, failover: the leader's authority ends and a standby takes over, adopting the leases decode holds, in
# honest operation (the failover itself is the event under study). With FORMAL_DEEP=1 also: with revocations (the
# new leader revoking an adopted lease, with the non-atomic step: 26 million states, three minutes), P5's formula
# across it, and the fault budget (75 million states, five minutes)
add model-failover           model "$here/pdserve.pml" "-DFAILOVER -DFAULTS=0" "$safety" "-m10000"
# the code's claim: the requests decoding, the others ended (any subset of those not yet reading left out)
add model-failover-claim-subset model "$here/pdserve.pml" "-DFAILOVER -DCLAIM_SUBSET -DFAULTS=0" "$safety" "-m10000"
if [ "${FORMAL_DEEP:-0}" = 1 ]; then
  add model-failover-revocations model "$here/pdserve.pml" "-DFAILOVER -DSTEP_WRITES -DFAULTS=0 -DREVOKE_FAULTS=1" "$safety" "-m10000"
  add model-failover-claim-subset-revocations model "$here/pdserve.pml" "-DFAILOVER -DCLAIM_SUBSET -DSTEP_WRITES -DFAULTS=0 -DREVOKE_FAULTS=1" "$safety -DCOLLAPSE" "-m10000"
  add model-ltl-drains-failover model "$here/pdserve.pml" "-DFAILOVER -DFAULTS=0" "-O1" "-m10000 -a -N drains"
  add model-failover-faults  model "$here/pdserve.pml" "-DFAILOVER" "$safety -DCOLLAPSE" "-m10000"
  add model-failover-step-writes-faults model "$here/pdserve.pml" "-DFAILOVER -DSTEP_WRITES" "$safety -DCOLLAPSE" "-m10000"
  add model-failover-both-run model "$here/pdserve.pml" "-DFAILOVER -DRUNPATH=3" "$safety -DCOLLAPSE" "-m10000"
  add model-two-faults       model "$here/pdserve.pml" "-DFAULTS=2" "$safety -DCOLLAPSE" "-m10000"
  add model-ltl-drains-lease-faults model "$here/pdserve.pml" "-DLEASE_FAULTS" "-O1" "-m10000 -a -N drains"
  # each request chooses its path at the grant (4.5x the states of model-default)
  add model-any-path         model "$here/pdserve.pml" "-DANYPATH=3" "$safety -DCOLLAPSE" "-m10000"
  add model-expiry-faults    model "$here/pdserve.pml" "-DEXPIRY" "$safety" "-m10000"
  add model-step-writes-lease-faults model "$here/pdserve.pml" "-DSTEP_WRITES -DLEASE_FAULTS" "$safety" "-m10000"
  add model-step-writes-both-run model "$here/pdserve.pml" "-DSTEP_WRITES -DRUNPATH=3" "$safety" "-m10000"
  add model-ltl-drains-step-writes model "$here/pdserve.pml" "-DSTEP_WRITES" "-O1" "-m10000 -a -N drains"
  # issue 19: r0 grows into a third page while r1 holds its own (3.5 GB); growth with the lease faults
  add model-growth-three-pages model "$here/pdserve.pml" "-DGROWTH -DNP=3" "$safety" "-m10000"
  add model-growth-lease-faults model "$here/pdserve.pml" "-DGROWTH -DGROWS=3 -DLEASE_FAULTS" "$safety" "-m10000"
  # issue 20: r1 of every content identity with the fault budget (3 times model-prefix)
  add model-prefix-contents-faults model "$here/pdserve.pml" "-DPREFIX" "$safety -DCOLLAPSE" "-m10000"
fi
# guards the model shows to be covered by others: they must not yield a counter-example
# (FORMAL_DEEP=1 also runs the *_deep.pml ones, which repeat an argument already checked)
for f in "$here"/redundant/*.pml; do
  case "$f" in *_deep.pml) [ "${FORMAL_DEEP:-0}" = 1 ] || continue ;; esac
  add "redundant-$(basename "$f" .pml)" model "$f" "" "$safety" "-m10000"
done
# mutants: depth-first, then shorter counter-examples: approximately (-I, as fast as the first error: ~5 s a
# mutant) by default, the shortest (-i, ~5x slower: iterative deepening) with FORMAL_DEEP=1;
# their searches are small, so -O0 (fast to compile) is the cheaper build
shorten=-I
[ "${FORMAL_DEEP:-0}" = 1 ] && shorten=-i
for f in "$here"/mutants/*.pml; do
  add "mutant-$(basename "$f" .pml)" mutant "$f" "" "-O0 -DSAFETY -DNOCLAIM -DREACH" "-m400 $shorten"
done
# the liveness formula must be able to fail too
add "mutant-endwrite_gives_up-ltl" mutant "$here/mutants/endwrite_gives_up.pml" "" "-O0" "-m10000 -a -N drains"

echo "formal: $(spin -V 2>/dev/null | head -1); $jobs parallel runs; build in $out"
for spec in "${specs[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  IFS='|' read -r name kind pml defs cflags args <<<"$spec"
  run_one "$name" "$kind" "$pml" "$defs" "$cflags" "$args" &
done
wait

fail=0
nmodel=0
nmutant=0
echo
printf '%-44s %-8s %12s %12s %6s %7s  %s\n' run errors states transitions depth secs verdict
for spec in "${specs[@]}"; do
  IFS='|' read -r name kind pml defs cflags args <<<"$spec"
  errors="" states="" transitions="" depth="" secs="" status=missing
  # shellcheck disable=SC1090,SC1091
  [ -f "$out/$name/result" ] && . "$out/$name/result"
  verdict=ok
  if [ "$status" != done ] || [ -z "$errors" ]; then
    verdict="FAIL ($status; see $out/$name)"
  elif [ "$kind" = model ] && [ "$errors" != 0 ]; then
    verdict="FAIL (expected errors: 0; see $out/$name)"
  elif [ "$kind" = mutant ] && [ "$errors" = 0 ]; then
    verdict="FAIL (mutant survived: no counter-example)"
  fi
  [ "$verdict" = ok ] || fail=1
  [ "$kind" = model ] && nmodel=$((nmodel + 1)) || nmutant=$((nmutant + 1))
  printf '%-44s %-8s %12s %12s %6s %7s  %s\n' "$name" "${errors:-?}" "${states:-?}" "${transitions:-?}" \
    "${depth:-?}" "${secs:-?}" "$verdict"
done

echo
echo "counter-examples (r<i>/e<epoch>/g<generation> names a lease; r-1/e0/g0 = a previous tenant's bytes;"
echo "r4/r5 = another prompt's bytes written under r0's/r1's lease):"
for spec in "${specs[@]}"; do
  IFS='|' read -r name kind _ <<<"$spec"
  [ "$kind" = mutant ] || continue
  echo
  echo "== $name"
  if [ -s "$out/$name/trace.txt" ]; then
    head -n 40 "$out/$name/trace.txt" | sed 's/^/   /'
  else
    echo "   (no trail)"
  fi
done

# a model run with errors: show where, to make a regression easy to read
for spec in "${specs[@]}"; do
  IFS='|' read -r name kind pml defs _ <<<"$spec"
  [ "$kind" = model ] || continue
  trail=$(ls "$out/$name"/*.trail 2>/dev/null | head -1)
  [ -n "$trail" ] || continue
  echo
  echo "== $name FAILED; its trail:"
  # shellcheck disable=SC2086
  (cd "$out/$name" && spin $defs -t -k "$trail" "$pml" 2>&1 |
    grep -E '^[[:space:]]*[A-Z]{3,} |^spin: ' | sed -E 's/^[[:space:]]+//' | head -n 60 | sed 's/^/   /')
done

echo
secs=$(($(date +%s) - t0))
if [ "$fail" = 0 ]; then
  echo "formal: PASS: $nmodel model runs report errors: 0, $nmutant mutant runs report a counter-example (${secs}s)"
else
  echo "formal: FAIL (${secs}s)"
fi
exit "$fail"

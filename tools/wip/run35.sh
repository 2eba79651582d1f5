#!/usr/bin/env bash
# memcheck and racecheck over sanitize_cases.py's paged cases, mma16 only.
export PYTHONUNBUFFERED=1 LOG=/tmp/run35; rm -rf $LOG; mkdir -p $LOG
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
for tool in memcheck racecheck; do extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  t0=$(date +%s); timeout 280 compute-sanitizer --tool $tool "${extra[@]}" --error-exitcode 3 --print-limit 1000 python3 scratch/san_mma16.py > $LOG/$tool.txt 2>&1
  echo "$tool rc=$? ($(( $(date +%s) - t0 )) s): $(grep -c '^ok' $LOG/$tool.txt) ok, $(grep -c '^FAIL' $LOG/$tool.txt) FAIL; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $LOG/$tool.txt | tail -1)"
done
tar czf $OUT/run35.tar.gz -C /tmp run35

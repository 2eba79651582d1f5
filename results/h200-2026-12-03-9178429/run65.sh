#!/usr/bin/env bash
export PYTHONUNBUFFERED=1 LOG=$OUT/run65; mkdir -p $LOG
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee -a $LOG/smi.txt
for spec in "b128v 128 normal:4096:2048" "b128 128 4096"; do set -- $spec; t0=$(date +%s)
  timeout 120 python3 -m mlasandbox.cli.main stalls --variant mma16 --batch $2 --lengths $3 --page-size 64 --blocks 6 --opcodes 8 --save $LOG/stalls_$1 > $LOG/stalls_$1.txt 2>&1
  echo "$1 rc=$? ($(( $(date +%s) - t0 )) s)"; cut -c1-150 $LOG/stalls_$1.txt | tail -75; rm -f $LOG/stalls_$1/*.ncu-rep; gzip -f $LOG/stalls_$1/source.csv 2>/dev/null
done

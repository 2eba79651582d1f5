#!/usr/bin/env bash
# Run from the repository root with scratch/ holding nowait.py and pick42.py (this folder) and
# scratch/o858pkg, main's package at b864c10 (the O side).
# The attention as q_absorb's programmatic dependent (N, this tree) against main (O): the GPU
# suite (the behind-q_absorb test included), the check's power (nowait.py), the batch-1 bench.
export PYTHONUNBUFFERED=1 LOG=/tmp/run42; rm -rf $LOG; mkdir -p $LOG
save() { tar czf $OUT/run42.tar.gz -C /tmp run42; }
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee $LOG/smi.txt
t0=$(date +%s)
timeout 270 python3 -m pytest -q -p no:cacheprovider -n 16 -rf > $LOG/pytest_gpu_suite.txt 2>&1
echo "suite: $(tail -1 $LOG/pytest_gpu_suite.txt) ($(( $(date +%s) - t0 )) s)"; grep -E '^FAILED|^ERROR' $LOG/pytest_gpu_suite.txt | cut -c1-300 | head; save
t0=$(date +%s); timeout 80 python3 scratch/nowait.py > $LOG/nowait.txt 2>&1; echo "nowait rc=$? ($(( $(date +%s) - t0 )) s)"; cat $LOG/nowait.txt | tail -30; save
run() { n=$1; v=$2; shift 2; t0=$(date +%s)
  if [ $v = N ]; then timeout 60 python3 -m mlasandbox.cli.main bench "$@" --aa-rounds 2 --target-ms 20 --graph always --json $LOG/$n.json > $LOG/$n.txt 2>&1
  else PYTHONPATH=$PWD/scratch/o858pkg timeout 60 python3 -m mlasandbox.cli.main bench "$@" --aa-rounds 2 --target-ms 20 --graph always --json $LOG/$n.json > $LOG/$n.txt 2>&1; fi
  echo "$n rc=$? ($(( $(date +%s) - t0 )) s)"; save; }
for r in 1 2; do
  run ab_N_h16_r$r N --heads 16 --ctx 64,1024,4096,131072 --variants mma16
  run ab_O_h16_r$r O --heads 16 --ctx 64,1024,4096,131072 --variants mma16
done
run ab_N_h128_r1 N --heads 128 --ctx 64,1024,4096 --variants mma32
run ab_O_h128_r1 O --heads 128 --ctx 64,1024,4096 --variants mma32
python3 scratch/pick42.py $LOG

#!/usr/bin/env bash
# Run from the repository root with scratch/ holding nowait.py and pick42.py (this folder) and
# scratch/o858pkg, main's package at b864c10 (the O side).
# The behind-q_absorb test (fixed reference) and its power (nowait.py).
export PYTHONUNBUFFERED=1 LOG=/tmp/run43; rm -rf $LOG; mkdir -p $LOG
save() { tar czf $OUT/run43.tar.gz -C /tmp run43; }
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
t0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 16 -rf tests/test_gpu_phases.py > $LOG/pytest_gpu_phases.txt 2>&1
echo "phases: $(tail -1 $LOG/pytest_gpu_phases.txt) ($(( $(date +%s) - t0 )) s)"; grep -E '^FAILED|^ERROR|^E  ' $LOG/pytest_gpu_phases.txt | cut -c1-300 | head; save
t0=$(date +%s); timeout 90 python3 scratch/nowait.py > $LOG/nowait.txt 2>&1; echo "nowait rc=$? ($(( $(date +%s) - t0 )) s)"; cat $LOG/nowait.txt | tail -30; save
